"""A fixture root's kernel: where a write to a board tree's plain file goes, so it behaves as
the real attribute does (cgroup v2's rules, the block layer's, the Jetson clock limits, then
the generic attribute emulation).  One dispatch for :meth:`agent.kernel.fsroot.Root.write_text`
instead of a special case there per model."""

from __future__ import annotations

import errno
from pathlib import Path

from agent.kernel import block_queue, cgroup_model, freq_qos, jetson_model, pages, pcie_aspm
from agent.kernel.attributes import Reader, emulate_attribute_write


def write(base: Path, path: str, logical: str, target: Path, value: str,
          read: Reader) -> None:
    """Write ``value`` to the fixture file ``target`` as the kernel would; OSError with the
    kernel's errno where it refuses.  ``path`` is the name written to (``/sys/block/...``),
    ``logical`` the file it resolves to inside the root."""
    if logical.startswith("/sys/fs/cgroup/") and cgroup_model.is_cgroup_dir(target.parent):
        cgroup_model.write(target, value, pages.tree_page_size(base))
        return
    if block_queue.handles(path):
        text = block_queue.write(base, target, value)
        if text is not None:  # None: a write the kernel ignores
            target.write_text(text)
        return
    if jetson_model.handles(logical):
        jetson_model.write(target, logical, value)
        return
    refusal = pcie_aspm.fixture_refusal(base, path)
    if refusal is not None:
        raise refusal
    if freq_qos.handles(logical):
        freq_qos.write(target, logical, value)
        return
    with open(target, "r+b") as handle:
        old = handle.read()
        data = emulate_attribute_write(old, value, path, read, base)
        handle.seek(0)
        written = handle.write(data)
        if len(data) < len(old):
            handle.truncate()
    if written != len(data):
        raise OSError(errno.EIO, f"{path}: short write ({written} of {len(data)} bytes)")
