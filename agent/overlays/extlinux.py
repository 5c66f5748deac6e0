"""``extlinux.conf`` (U-Boot distro boot and Jetson's UEFI L4TLauncher): pure text edits.

extlinux has no automatic A/B, so the booting entry is never edited: the DEFAULT entry is
copied to a new ``LABEL edge-agent`` that carries the overlays, DEFAULT points at the copy,
and the original stays in the menu as the fallback (jetson-io does the same).  Kernel
arguments (``APPEND``) are edited on the same copy, made by whichever needs it first.  Once the
copy equals its source entry again (apart from its label lines and an FDT line added for
overlays), the copy is deleted and DEFAULT restored, whatever order things were removed in.
Keywords are matched case-insensitively and written in the file's own spelling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.overlays import kargs
from agent.overlays.errors import InstallRefused

LABEL = "edge-agent"
MARK = "# edge-agent overlays: a copy of LABEL {source}; removing the last one restores " \
       "DEFAULT {source}"
MARK_ARGS = "# edge-agent settings: a copy of LABEL {source}; removing the last one restores " \
    "DEFAULT {source}"
MARK_PATTERN = re.compile(r"^# edge-agent (?:overlays|settings): a copy of LABEL (\S+);")
LINE = re.compile(r"^([ \t]*)(\S+)([ \t]*)(.*?)(\r?\n)?$")


@dataclass(frozen=True)
class Dialect:
    name: str
    keyword: str                  # written when an entry has no overlay line yet
    keywords: tuple[str, ...]     # overlay keywords recognised (lower case)
    separator: str
    needs_fdt: bool               # overlays apply only when the entry has an FDT line


# Jetson JP6+: comma-separated OVERLAYS, applied only with an FDT line in the same LABEL
JETSON = Dialect("jetson", "OVERLAYS", ("overlays",), ",", needs_fdt=True)
# U-Boot: space-separated fdtoverlays (alias devicetree-overlay)
UBOOT = Dialect("extlinux", "fdtoverlays", ("fdtoverlays", "devicetree-overlay"), " ",
                needs_fdt=False)


def _keyword(line: str) -> str:
    match = LINE.match(line)
    return "" if match is None or match.group(2).startswith("#") else match.group(2).lower()


def _value(line: str) -> str:
    match = LINE.match(line)
    return match.group(4).strip() if match else ""


def _with_value(line: str, value: str) -> str:
    match = LINE.match(line)
    if match is None:  # a blank line has no value to replace
        return line
    indent, keyword, space, _, ending = match.groups()
    return f"{indent}{keyword}{space or ' '}{value}{ending or ''}"


def _default(lines: list[str]) -> int:
    for index, line in enumerate(lines):
        if _keyword(line) == "default":
            return index
    raise InstallRefused("extlinux.conf has no DEFAULT line, so the entry that boots is "
                         "unknown; add one (DEFAULT <label>) first")


def _set_default(lines: list[str], name: str) -> None:
    index = _default(lines)
    if _value(lines[index]) != name:
        lines[index] = _with_value(lines[index], name)


def _blocks(lines: list[str]) -> dict[str, tuple[int, int]]:
    """LABEL name -> [start, end) of its lines, trailing blank and comment lines left out."""
    starts = [i for i, line in enumerate(lines) if _keyword(line) == "label"]
    blocks = {}
    for start, following in zip(starts, [*starts[1:], len(lines)], strict=True):
        end = following
        while end > start + 1 and not _keyword(lines[end - 1]):
            end -= 1
        blocks[_value(lines[start])] = (start, end)
    return blocks


def _overlay_line(lines: list[str], block: tuple[int, int], dialect: Dialect) -> int | None:
    found = [i for i in range(*block) if _keyword(lines[i]) in dialect.keywords]
    return found[-1] if found else None


def _paths(line: str, dialect: Dialect) -> list[str]:
    return [p.strip() for p in _value(line).split(dialect.separator.strip() or None) if p.strip()]


def default_entry(text: str) -> tuple[str, list[str]]:
    """The DEFAULT label and that entry's lines."""
    lines = text.splitlines(keepends=True)
    name = _value(lines[_default(lines)])
    blocks = _blocks(lines)
    if name not in blocks:
        raise InstallRefused(f"extlinux.conf: DEFAULT names LABEL {name}, which it does not "
                             "define")
    return name, lines[slice(*blocks[name])]


def entry_value(entry: list[str], keyword: str) -> str | None:
    """The value of a keyword line (``linux``, ``fdt``) in an entry's lines."""
    found = [_value(line) for line in entry if _keyword(line) == keyword]
    return found[-1] if found else None


def overlays(text: str, dialect: Dialect) -> list[str]:
    """The overlay paths of the DEFAULT entry, in order."""
    _, entry = default_entry(text)
    index = _overlay_line(entry, (0, len(entry)), dialect)
    return [] if index is None else _paths(entry[index], dialect)


def _indent(entry: list[str]) -> str:
    match = LINE.match(entry[1] if len(entry) > 1 else "\t")
    return match.group(1) if match and match.group(1) else "\t"


def _insert_after(entry: list[str], keywords: tuple[str, ...], line: str) -> None:
    """Put ``line`` after the last line with one of ``keywords``, else at the entry's end."""
    hits = [i for i, old in enumerate(entry) if _keyword(old) in keywords]
    entry.insert(hits[-1] + 1 if hits else len(entry), line)


def _add_path(entry: list[str], path: str, dialect: Dialect, ending: str) -> None:
    index = _overlay_line(entry, (0, len(entry)), dialect)
    if index is None:
        _insert_after(entry, ("fdt", "devicetree", "fdtdir", "linux", "kernel"),
                      f"{_indent(entry)}{dialect.keyword} {path}{ending}")
        return
    paths = _paths(entry[index], dialect)
    if path not in paths:
        entry[index] = _with_value(entry[index], dialect.separator.join([*paths, path]))


def register(text: str, path: str, dialect: Dialect, fdt: str | None = None) -> str:
    """Add ``path`` to the edge-agent copy of the DEFAULT entry (made, just before the
    original, on the first install) and point DEFAULT at the copy.

    ``fdt`` is the DTB to name when the copied entry has no FDT line and the dialect needs
    one; without it such an entry is refused.
    """
    lines = text.splitlines(keepends=True)
    blocks = _blocks(lines)
    ours = LABEL in blocks
    source, entry = (LABEL, lines[slice(*blocks[LABEL])]) if ours else default_entry(text)
    ending = _ending(entry[0])
    if dialect.needs_fdt and entry_value(entry, "fdt") is None:  # a copy made for arguments
        if fdt is None:
            raise InstallRefused(f"LABEL {source} has no FDT line, and {dialect.name} applies "
                                 "overlays only with one: add FDT /boot/dtb/<the board's "
                                 "DTB> to it first")
        _insert_after(entry, ("linux", "kernel"), f"{_indent(entry)}FDT {fdt}{ending}")
    _add_path(entry, path, dialect, ending)
    if not ours:
        return _with_copy(lines, blocks, source, entry, MARK, "overlays")
    start, end = blocks[LABEL]
    _set_default(lines, LABEL)
    return "".join([*lines[:start], *entry, *lines[end:]])


def _with_copy(lines: list[str], blocks: dict[str, tuple[int, int]], source: str,
               entry: list[str], mark: str, what: str) -> str:
    """The file with ``entry`` (the source's lines, edited) added as LABEL edge-agent just
    before its source, marked, and DEFAULT pointing at it."""
    ending = _ending(entry[0])
    entry[0] = _with_value(entry[0], LABEL)
    for index, line in enumerate(entry):
        if _keyword(line) == "menu" and _value(line).lower().startswith("label"):
            entry[index] = _with_value(line, f"{_value(line)} + edge-agent {what}")
    if not entry[-1].endswith("\n"):  # the last entry of a file without a final newline
        entry[-1] += ending
    _set_default(lines, LABEL)
    start = blocks[source][0]
    return "".join([*lines[:start], mark.format(source=source) + ending, *entry, ending,
                    *lines[start:]])


def unregister(text: str, path: str, dialect: Dialect) -> str:
    """Take ``path`` out; with no edge-agent overlay left, the copy goes and DEFAULT returns."""
    lines = text.splitlines(keepends=True)
    blocks = _blocks(lines)
    ours = LABEL in blocks
    index = _overlay_line(lines, blocks[LABEL if ours else default_entry(text)[0]], dialect)
    if index is None or path not in _paths(lines[index], dialect):
        return text
    rest = [p for p in _paths(lines[index], dialect) if p != path]
    if rest:
        lines[index] = _with_value(lines[index], dialect.separator.join(rest))
    else:
        del lines[index]
    if not ours:  # the copy is gone (Radxa's u-boot-update rewrites the file)
        return "".join(lines)
    return _drop_copy_if_unchanged(lines)


def _is_label_line(line: str) -> bool:
    return _keyword(line) == "label" or (_keyword(line) == "menu" and
                                         _value(line).lower().startswith("label"))


def _same_entry(copy: list[str], source: list[str]) -> bool:
    """The copy holds nothing edge-agent added: equal to its source except the label lines
    (and an FDT line added for overlays when the source has none)."""
    no_fdt = entry_value(source, "fdt") is None
    kept = [line.rstrip("\r\n") for line in copy if not _is_label_line(line)
            and not (no_fdt and _keyword(line) == "fdt")]
    return kept == [line.rstrip("\r\n") for line in source if not _is_label_line(line)]


def _drop_copy_if_unchanged(lines: list[str]) -> str:
    """Delete the copy (and its mark) and point DEFAULT back at the source once nothing
    edge-agent added remains in it; a copy edited by hand stays."""
    blocks = _blocks(lines)
    start, end = blocks[LABEL]
    mark = MARK_PATTERN.match(lines[start - 1]) if start else None
    source = mark.group(1) if mark else None
    if source is None or source not in blocks or not _same_entry(
            lines[start:end], lines[slice(*blocks[source])]):
        return "".join(lines)  # edge-agent settings remain, or the copy was edited by hand
    if _value(lines[_default(lines)]) == LABEL:
        _set_default(lines, source)
    last = end + 1 if end < len(lines) and not lines[end].strip() else end
    return "".join([*lines[:start - 1], *lines[last:]])


def _args_entry(text: str) -> tuple[list[str], dict[str, tuple[int, int]], str]:
    """The lines, their blocks, and the label of the entry whose arguments count: the copy
    when there is one, else the DEFAULT entry."""
    lines = text.splitlines(keepends=True)
    blocks = _blocks(lines)
    return lines, blocks, LABEL if LABEL in blocks else default_entry(text)[0]


def _append_line(lines: list[str], block: tuple[int, int]) -> int | None:
    found = [i for i in range(*block) if _keyword(lines[i]) == "append"]
    return found[-1] if found else None


def _raw_value(line: str) -> str:
    match = LINE.match(line)
    return match.group(4) if match else ""


def argument(text: str, name: str) -> str:
    """The kernel argument ``name`` (the whole token) on the entry that boots; "" if none."""
    lines, blocks, label = _args_entry(text)
    index = _append_line(lines, blocks[label])
    return "" if index is None else kargs.find(_raw_value(lines[index]), name)


def set_argument(text: str, name: str, token: str) -> str:
    """Set (``token``) or take out ("") a kernel argument on the edge-agent copy, made from
    the DEFAULT entry when it is first needed; the booting entry itself is never edited."""
    lines, blocks, label = _args_entry(text)
    if label != LABEL:
        source, entry = default_entry(text)
        index = _append_line(entry, (0, len(entry)))
        if kargs.find("" if index is None else _raw_value(entry[index]), name) == token:
            return text  # already so on the booting entry: no copy is needed
        _set_in_entry(entry, name, token, source_has_append=index is not None)
        return _with_copy(lines, blocks, source, entry, MARK_ARGS, "settings")
    start, end = blocks[LABEL]
    entry = lines[start:end]
    mark = MARK_PATTERN.match(lines[start - 1]) if start else None
    block = blocks.get(mark.group(1)) if mark else None
    source_has_append = block is None or _append_line(lines, block) is not None
    _set_in_entry(entry, name, token, source_has_append)
    _set_default(lines, LABEL)
    return _drop_copy_if_unchanged([*lines[:start], *entry, *lines[end:]])


def _set_in_entry(entry: list[str], name: str, token: str, source_has_append: bool) -> None:
    index = _append_line(entry, (0, len(entry)))
    if index is None:
        if token:
            label = LINE.match(entry[0])
            keyword = "APPEND" if label and label.group(2).isupper() else "append"
            _insert_after(entry, ("linux", "kernel", "initrd", "fdt", "devicetree", "fdtdir",
                                  "overlays", "fdtoverlays", "devicetree-overlay"),
                          f"{_indent(entry)}{keyword} {token}{_ending(entry[0])}")
        return
    value = kargs.set_token(_raw_value(entry[index]), name, token)
    if not value.strip() and not source_has_append:
        del entry[index]  # the line edge-agent added for its first argument
    else:
        entry[index] = _with_value(entry[index], value)


def _ending(line: str) -> str:
    return "\r\n" if line.endswith("\r\n") else "\n"


def copy_source(text: str) -> str | None:
    """The label the edge-agent copy was made from (its mark), None without a copy."""
    lines = text.splitlines(keepends=True)
    blocks = _blocks(lines)
    if LABEL not in blocks or not blocks[LABEL][0]:
        return None
    mark = MARK_PATTERN.match(lines[blocks[LABEL][0] - 1])
    return mark.group(1) if mark else None


def set_fallback(text: str, label: str) -> str:
    """``FALLBACK label`` (U-Boot's pxe parser, boot/pxe_utils.c: the entry booted instead
    of DEFAULT once the extlinux bootmeth's fallback property is set) after DEFAULT, in the
    DEFAULT line's own case; an existing FALLBACK line is re-pointed."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if _keyword(line) == "fallback"]
    if found:
        lines[found[-1]] = _with_value(lines[found[-1]], label)
        return "".join(lines)
    index = _default(lines)
    match = LINE.match(lines[index])
    keyword = "FALLBACK" if match is not None and match.group(2).isupper() else "fallback"
    lines.insert(index + 1, f"{keyword} {label}{_ending(lines[index])}")
    return "".join(lines)


def clear_fallback(text: str, label: str) -> str:
    """Take out a FALLBACK line that names ``label`` (the one edge-agent added)."""
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not (_keyword(line) == "fallback"
                                           and _value(line) == label)]
    return "".join(kept)
