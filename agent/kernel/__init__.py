"""The kernel interface every subsystem stands on: the root-relative filesystem layer
(``fsroot``), a tolerant sysfs/procfs reader, parsers of the kernel's text formats, and the
thread-scheduling syscalls (``sched``).  Discovery, telemetry, tuning and inference all read
and write the device through it; it imports nothing else of the agent."""
