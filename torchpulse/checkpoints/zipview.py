"""Minimal reader of the zip archives `torch.save` writes, for one item inside a file.

`zipfile` would do, but it cannot read an archive that starts at an offset
inside a bigger file without a wrapper, and it re-reads headers per member.
Here the central directory is read once, then members are streamed in order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_TAIL = 65536 + 22


class ZipFormatError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    crc32: int
    size: int
    method: int
    local_offset: int


# pread(offset_within_item, nbytes) -> bytes
ReadAt = Callable[[int, int], bytes]


def central_directory(read_at: ReadAt, length: int) -> list[Member]:
    """Parse the members of the archive occupying bytes [0, length) of `read_at`."""
    tail_start = max(0, length - _TAIL)
    tail = read_at(tail_start, length - tail_start)
    pos = tail.rfind(_EOCD)
    if pos < 0 or len(tail) - pos < 22:
        raise ZipFormatError("no end-of-central-directory record")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<4sHHHHIIH", tail, pos)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc = pos - 20
        if loc < 0 or tail[loc : loc + 4] != _ZIP64_LOCATOR:
            raise ZipFormatError("zip64 locator missing")
        (eocd64_at,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = read_at(eocd64_at, 56)
        if rec[:4] != _ZIP64_EOCD:
            raise ZipFormatError("zip64 end record missing")
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", rec, 32)
    if cd_offset + cd_size > length:
        raise ZipFormatError("central directory past the end of the item")
    cd = read_at(cd_offset, cd_size)
    members: list[Member] = []
    names: set[str] = set()
    at = 0
    for _ in range(count):
        if cd[at : at + 4] != _CENTRAL:
            raise ZipFormatError("bad central directory entry")
        (method, crc, csize, usize, nlen, elen, clen) = struct.unpack_from("<10xH4xIIIHHH", cd, at)
        (local,) = struct.unpack_from("<I", cd, at + 42)
        name = cd[at + 46 : at + 46 + nlen].decode("utf-8", "replace")
        extra = cd[at + 46 + nlen : at + 46 + nlen + elen]
        if 0xFFFFFFFF in (csize, usize, local):
            usize, csize, local = _zip64_extra(extra, usize, csize, local)
        if csize != usize and method == 0:
            raise ZipFormatError(f"{name}: stored member with two sizes")
        if name in names:
            # torch.save never writes one; which copy a reader takes is up to the reader, so the
            # copy checked here need not be the one torch.load reads.
            raise ZipFormatError(f"{name}: two members with this name")
        names.add(name)
        members.append(Member(name, crc, csize, method, local))
        at += 46 + nlen + elen + clen
    return members


def _zip64_extra(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            fields = list(struct.unpack_from(f"<{size // 8}Q", extra, at + 4))
            wanted = [usize, csize, local].count(0xFFFFFFFF)
            if len(fields) < wanted:
                raise ZipFormatError(f"zip64 extra holds {len(fields)} of the {wanted} sizes it should")
            if usize == 0xFFFFFFFF:
                usize = fields.pop(0)
            if csize == 0xFFFFFFFF:
                csize = fields.pop(0)
            if local == 0xFFFFFFFF:
                local = fields.pop(0)
            return usize, csize, local
        at += 4 + size
    raise ZipFormatError("zip64 sizes missing")


def data_offset(read_at: ReadAt, member: Member) -> int:
    """Where the member's bytes start: after its local header, whose lengths may differ."""
    head = read_at(member.local_offset, 30)
    if len(head) != 30 or head[:4] != _LOCAL:
        raise ZipFormatError(f"{member.name}: bad local header")
    nlen, elen = struct.unpack_from("<HH", head, 26)
    return member.local_offset + 30 + int(nlen) + int(elen)
