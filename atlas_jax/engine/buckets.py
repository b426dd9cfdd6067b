"""The step shape grid: which padded-dense segment shapes (batch.py) the runner compiles.

A step's shape is a tuple of segments, each (rows B, tokens T). A shape `covers` another of the same
kind and structure when each of its segments is at least as large in both dimensions: padding rows
and columns are inert, so a covering shape runs any batch the smaller one runs, only slower. Warm-up
compiles the maximal shapes first (they cover every batch) and the rest by cost (executables.py).
"""
from __future__ import annotations

import dataclasses

Shape = tuple                  # ((B, T), ...) per segment; None for the operations without a shape grid


def bucket(n: int, cap: int | None = None) -> int:
    b = 1 << max(0, (n - 1).bit_length())
    return min(b, cap) if cap else b


def powers_of_two(cap: int) -> list[int]:
    return [1 << i for i in range(bucket(cap).bit_length())]


def mixed_decode_buckets(decode_buckets: list[int]) -> list[int]:
    """Decode-segment sizes of mixed steps: the decode buckets from max(16, Bd_max / 4) up (at most three; Bd_max
    alone when it is <= 16). A mixed step is compute-bound on CPU, so every padding row costs a prompt token's work: with
    only Bd_max, a 64-slot engine ran 60 padding rows beside 4 decoding ones. Below 16 rows the padding is
    small beside the >= 16-token prefill segment, and the compiles (|these| x |prefill shapes|) stay few."""
    top = decode_buckets[-1]
    return [b for b in decode_buckets if b >= min(top, max(16, top // 4))]


def prefill_token_buckets(max_chunk: int) -> list[int]:
    """Tp buckets: 16, 64, then doubling (128, 256, ...) below max_chunk, and max_chunk itself. From 64
    tokens up a chunk is padded to less than twice its length (a step's cost there grows with its tokens);
    below, a step costs mostly its weight sweep, so fewer buckets."""
    out, t = [], 16
    while t < max_chunk:
        out.append(t)
        t = t * 4 if t < 64 else t * 2
    return out + [max_chunk]


def covers(big: Shape, small: Shape) -> bool:
    """`big` can run any batch `small` runs (same segments, each at least as many rows and tokens)."""
    if big is None or small is None:
        return big == small
    return len(big) == len(small) and all(b >= s and t >= u for (b, t), (s, u) in zip(big, small))


def cost(shape: Shape) -> int:
    """Padded tokens a step of this shape computes (what a covering shape wastes grows with it)."""
    return 0 if shape is None else sum(b * t for b, t in shape)


def maximal(shapes: list[Shape]) -> list[Shape]:
    """The shapes no other shape in `shapes` covers."""
    return [s for s in shapes if not any(o != s and covers(o, s) for o in shapes)]


@dataclasses.dataclass(frozen=True)
class Grid:
    """An engine's bucket grid (runner.py's docstring has the policy)."""
    decode_buckets: list[int]              # decode rows Bd: powers of two up to bucket(max_num_seqs)
    prefill_row_buckets: list[int]         # prefill rows Bp: powers of two up to max_prefill_rows
    prefill_token_buckets: list[int]       # prefill tokens Tp (prefill_token_buckets)
    mixed_decode_buckets: list[int]        # a mixed step's decode rows (mixed_decode_buckets)
    verify_sizes: list[int]                # verify K: the last token + K - 1 drafts, K >= 2

    @classmethod
    def create(cls, max_num_seqs: int, max_prefill_rows: int, max_prefill_chunk: int, max_verify_tokens: int):
        decode = powers_of_two(max_num_seqs)
        return cls(decode, powers_of_two(max_prefill_rows), prefill_token_buckets(max_prefill_chunk),
                   mixed_decode_buckets(decode), list(range(2, max_verify_tokens + 1)))

    def prefill_shapes(self) -> list[tuple[int, int]]:
        return [(bp, tp) for tp in self.prefill_token_buckets for bp in self.prefill_row_buckets]

    def step_shapes(self) -> list[Shape]:
        """Every segment-shape tuple a step can run: decode alone, mixed, prefill alone."""
        prefill = self.prefill_shapes()
        return ([((b, 1),) for b in self.decode_buckets] + [((bm, 1), p) for bm in self.mixed_decode_buckets
                                                             for p in prefill] + [(p,) for p in prefill])

    def verify_shapes(self) -> list[Shape]:
        """Every segment-shape tuple a verify step can run: [B, K] alone, and [B_max, K_max] + each prefill shape."""
        if not self.verify_sizes:
            return []
        top = (self.decode_buckets[-1], self.verify_sizes[-1])
        return ([((b, k),) for k in self.verify_sizes for b in self.decode_buckets]
                + [(top, p) for p in self.prefill_shapes()])

    def prefill_shape(self, rows: int, tokens: int) -> tuple[int, int]:
        """The prefill segment for `rows` rows of up to `tokens` tokens."""
        tp = next((t for t in self.prefill_token_buckets if t >= tokens), None)
        bp = next((b for b in self.prefill_row_buckets if b >= rows), None)
        if tp is None or bp is None:
            raise ValueError(f"{rows} prefill rows of up to {tokens} tokens exceed the compiled buckets "
                             f"(rows <= {self.prefill_row_buckets[-1]}, tokens <= {self.prefill_token_buckets[-1]})")
        return bp, tp
