"""Writes the kernel refuses at apply time that a plan could not foresee, and which of them
skip instead of failing the apply.

A section the profile lists under ``optional`` (or only inherits) is one the profile can do
without, as a knob the kernel lacks is skipped for it at plan time.  A refusal the plan could
not see (ASPM policy writes under firmware ASPM control answer EPERM: the _OSC negotiation
leaves no trace in sysfs; see docs/kernel-facts/refusals.md) is the same case met later: the
write is skipped with its reason, and the skip is journaled so verify does not call it drift
and rollback does not write an original the kernel never let change.  For a key the profile
asks for itself the refusal still fails the apply, which undoes every earlier write.
"""

from __future__ import annotations

import errno

from agent.tuning.plan import Change

ENOTSUPP = 524  # the kernel's internal "not supported", which some sysctls leak to user space
# what the kernel answers a write it will not take: the attribute exists, the value or the
# moment is refused (not a missing file, not an I/O error of the agent's own)
REFUSALS = frozenset({errno.EPERM, errno.EACCES, errno.EINVAL, errno.EBUSY, errno.EIO,
                      errno.ENODEV, errno.ENXIO, errno.EOPNOTSUPP, errno.ERANGE,
                      errno.EOVERFLOW, errno.EAGAIN, ENOTSUPP})


def errno_name(number: int | None) -> str:
    if number == ENOTSUPP:
        return "ENOTSUPP"
    return errno.errorcode.get(number or 0, f"errno {number}")


def optional_refusal(change: Change, error: BaseException, optional: frozenset[str]) -> \
        str | None:
    """The skip reason when ``change`` belongs to an optional (or inherited) key and the
    kernel refused it; None when the refusal must fail the apply."""
    if not isinstance(error, OSError) or error.errno not in REFUSALS:
        return None
    if change.key not in optional:
        return None
    section = change.key.split(".")[0]
    return (f"the kernel refused the write ({errno_name(error.errno)}: {error.strerror or error}"
            f"); {section} is optional in this profile (listed under optional, or inherited), "
            f"so {change.key} is skipped, not applied")
