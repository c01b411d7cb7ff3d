# Derives the stored bit order of the routed experts' MXFP4 code words (CODE_BIT_SOURCE in
# kernels/src/cuda/expert_layout.rs) for word_codes_bf16x2 in kernels/cuda/moe.cu, and checks it.
#
# The kernel turns a 32-bit word of 8 E2M1 codes into four bf16x2 registers of code * 2^-126: register j holds code
# 2j in its low half and code 2j + 1 in its high half, each code's bits at KEEP's places (sign 15, exponent 8-7,
# mantissa 6, and the same +16). The stored order is free (the upload permutes each word), so the question is the
# fewest integer instructions from a word to the four registers. The form searched: each register is
# `rotl(src, b) & KEEP` with src the word or one blend u = (w & M) | ((w << A) & ~M); a register with b = 0 costs
# its mask alone. A stored bit must land in exactly one register place, which is a perfect matching between the
# 32 places read and the 32 stored bits. With one such blend there is a form of 9 instructions (2 for u, 3
# rotations, 4 masks) and none of 8; the checkpoint's nibble order takes 11.
#
# python3 kernels/bench/code_bit_order.py  (prints whether 8 instructions can do it, then M and the order)
import itertools
import random
import sys

KEEP_BITS = [6, 7, 8, 15, 22, 23, 24, 31]
KEEP = sum(1 << p for p in KEEP_BITS)
FIELD = {6: 0, 7: 1, 8: 2, 15: 3}  # mantissa, exponent bit 0, exponent bit 1, sign: bit 4i + field of code i


def rotl(x, b):
    return ((x << b) | (x >> (32 - b))) & 0xFFFFFFFF if b else x


def places(b):
    """The source-register bits that rotl(src, b) & KEEP reads, in KEEP_BITS order."""
    return [(p - b) % 32 for p in KEEP_BITS]


def blend_sources(a, q):
    """The stored bits that bit q of u = (w & M) | ((w << a) & ~M) can hold."""
    return [q] + ([q - a] if q - a >= 0 else [])


def match(cands):
    """A perfect matching of reads (each a list of candidate stored bits) to stored bits, or None."""
    owner = {}

    def augment(i, seen):
        for s in cands[i]:
            if s not in seen:
                seen.add(s)
                if s not in owner or augment(owner[s], seen):
                    owner[s] = i
                    return True
        return False

    return owner if all(augment(i, set()) for i in range(len(cands))) else None


def rotation_tuples(max_rotations):
    """Rotations of the four registers with at most `max_rotations` of them nonzero."""
    for nonzero in itertools.product([False, True], repeat=4):
        if sum(nonzero) <= max_rotations:
            yield from itertools.product(*[range(1, 32) if z else [0] for z in nonzero])


def matching_of(a, srcs, rots):
    """The matching of the form's reads to stored bits (w reads first, then u reads), or None."""
    reads = {"w": [], "u": []}
    for s, b in zip(srcs, rots):
        reads[s] += places(b)
    if any(len(set(r)) < len(r) for r in reads.values()):
        return None
    return match([[q] for q in reads["w"]] + [blend_sources(a, q) for q in reads["u"]])


def exists(max_rotations):
    """Whether some form with one blend and at most `max_rotations` rotations places every bit."""
    for a in range(1, 32):
        for srcs in itertools.product("wu", repeat=4):
            if "u" in srcs and any(matching_of(a, srcs, r) for r in rotation_tuples(max_rotations)):
                return True
    return False


def order(a, srcs, rots, owner):
    """CODE_BIT_SOURCE (stored bit s holds checkpoint bit order[s]) and the blend mask M."""
    reads = []  # (source, place read, checkpoint bit), in the order match() saw them: w reads, then u reads
    for want in "wu":
        for j, (s, b) in enumerate(zip(srcs, rots)):
            if s != want:
                continue
            for p, q in zip(KEEP_BITS, places(b)):
                code = 2 * j + p // 16
                reads.append((s, q, 4 * code + FIELD[p % 16]))
    source, mask = [None] * 32, 0
    for stored, i in owner.items():
        s, q, bit = reads[i]
        source[stored] = bit
        if s == "u" and stored == q:
            mask |= 1 << q
    return source, mask


def check(a, srcs, rots, source, mask):
    def stored(w):
        return sum(((w >> source[s]) & 1) << s for s in range(32))

    def convert(w):
        u = (w & mask) | ((w << a) & ~mask & 0xFFFFFFFF)
        return [rotl(w if s == "w" else u, b) & KEEP for s, b in zip(srcs, rots)]

    def bits(c):
        return ((c >> 3) << 15) | (((c >> 1) & 3) << 7) | ((c & 1) << 6)

    def plain(w):
        return [bits((w >> (8 * j)) & 15) | (bits((w >> (8 * j + 4)) & 15) << 16) for j in range(4)]

    words = [random.getrandbits(32) for _ in range(100_000)] + [0, 0xFFFFFFFF, 0x88888888, 0x77777777]
    assert all(convert(stored(w)) == plain(w) for w in words)


# The 9-instruction form word_codes_bf16x2 uses: u = the blend of w and w << 2;
# registers 0..3 = rotl(w, 13), rotl(w, 8), rotl(u, 3), u, each masked.
FORM = (2, ("w", "w", "u", "u"), (13, 8, 3, 0))


def main():
    random.seed(0)
    print("a form with one blend and 2 rotations (8 instructions):", "exists" if exists(2) else "none")
    a, srcs, rots = FORM
    owner = matching_of(a, srcs, rots)
    if owner is None:
        sys.exit("the kernel's form places no bit order")
    source, mask = order(a, srcs, rots, owner)
    assert sorted(source) == list(range(32))
    check(a, srcs, rots, source, mask)
    print(f"u = (w & {mask:#010x}) | ((w << {a}) & ~{mask:#010x})  (CODE_BLEND_MASK)")
    for j, (s, b) in enumerate(zip(srcs, rots)):
        print(f"register {j} = rotl({s}, {b}) & {KEEP:#010x}")
    print("CODE_BIT_SOURCE =", source)


if __name__ == "__main__":
    main()
