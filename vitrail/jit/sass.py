"""Checks on disassembled machine code (``Module.sass``, cuobjdump's listing).

``wgmma_register_hazards``: a wgmma whose A operand comes from registers (HGMMA with an R
source) reads them asynchronously, until the ``wgmma.wait_group`` that retires its group
(WARPGROUP.DEPBAR). The compiler does not always keep them: it has been seen to build the next
k-block's fragments in the registers of a wgmma still in flight across a loop's back edge,
which gives wrong values on a few problems of a large batch. This reads a kernel's SASS and
lists every instruction that writes such a register before the group that reads it retired.
"""
from __future__ import annotations

import re

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
# opcodes that write no general register (or only predicates / memory / barriers)
_NO_REGISTER_WRITE = ("ST", "BAR", "BRA", "LDGSTS", "WARPGROUP", "DEPBAR", "FENCE", "MEMBAR",
                      "RED", "EXIT", "NOP", "LDGDEPBAR", "WARPSYNC", "ISETP", "FSETP", "HSETP",
                      "DSETP", "UISETP", "PLOP3", "SYNCS", "UTMA", "BSSY", "BSYNC", "CALL", "RET",
                      "ELECT", "VOTEU", "UMOV", "UIADD", "ULOP", "USHF", "ULEA", "UIMAD", "ULDC",
                      "R2UR", "S2UR", "UPRMT", "USEL", "UFLO", "UPOPC", "UBMSK", "USGXT")


def kernel_sass(listing: str, kernel: str) -> str:
    """The part of a cuobjdump -sass listing that is ``kernel``'s code."""
    head = f"Function : {kernel}\n"
    if head not in listing:
        raise KeyError(f"no function '{kernel}' in the listing")
    return listing.split(head, 1)[1].split("Function : ", 1)[0]


def _parse(sass: str) -> list[tuple[int, str, str]]:
    return [(int(m.group(1), 16), m.group(3), m.group(4).strip())
            for m in _INSTRUCTION.finditer(sass)]


def _written(op: str, args: str) -> set[int]:
    if op.startswith(_NO_REGISTER_WRITE) or op.startswith("HGMMA"):
        return set()
    first = re.match(r"R(\d+)\b", args.split(",")[0].strip())
    if not first:
        return set()
    n = 4 if ".128" in op else 2 if (".64" in op or op.startswith(("CS2R", "IMAD.WIDE",
                                                                   "DADD", "DMUL", "DFMA"))) else 1
    return set(range(int(first.group(1)), int(first.group(1)) + n))


def _scan(code: list[tuple[int, str, str]]) -> list[str]:
    found, pending, group = [], [], set()
    for pc, op, args in code:
        if op.startswith("HGMMA"):
            src = args.split(",")[1].strip()
            if src.startswith("R"):
                group |= set(range(int(src[1:]), int(src[1:]) + 4))
            if "gsb0" in args:  # the end of a group (wgmma.commit_group)
                pending.append(group)
                group = set()
            continue
        if op.startswith("WARPGROUP.DEPBAR"):  # wait_group n: all but the n newest retired
            n = int(args.split(",")[1], 16)
            while len(pending) > n:
                pending.pop(0)
            continue
        hit = _written(op, args) & set().union(group, *pending)
        if hit:
            found.append(f"{pc:04x} {op} {args}: writes R{', R'.join(map(str, sorted(hit)))} "
                         f"while a wgmma reads it")
    return found


def wgmma_register_hazards(sass: str) -> list[str]:
    """Writes to registers an in-flight wgmma reads as its A operand, in one kernel's SASS
    (``kernel_sass``): straight through the code, then each loop that holds wgmmas (a branch
    back to a lower address) twice, so that what is in flight at its back edge meets the next
    iteration. Returns one line per hazard (none: an empty list). Instructions are followed in
    address order: predication and branches inside a loop are not modeled."""
    code = _parse(sass)
    found = _scan(code)
    addresses = [pc for pc, _, _ in code]
    for i, (pc, op, args) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", args)
        if not (op.startswith("BRA") and target) or int(target.group(1), 16) >= pc:
            continue
        start = int(target.group(1), 16)
        if start not in addresses:
            continue
        body = code[addresses.index(start):i + 1]
        if any(o.startswith("HGMMA") for _, o, _ in body):
            found += [f"loop {start:04x}-{pc:04x}: {h}" for h in _scan(body + body)]
    return sorted(set(found))
