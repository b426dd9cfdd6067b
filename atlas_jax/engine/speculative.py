"""Speculative decoding: drafters ("proposers") and the acceptance bookkeeping the engine keeps.

A decode step with drafts is a *verify* step (runner.verify): each row feeds its last token plus
its drafts; the target's logits at every position decide how many drafts are accepted
(sampler.verify), and the row emits the accepted drafts plus one token of the target's own.
Rollback costs nothing: KV beyond the accepted tokens is simply overwritten later (the host's
num_cached moves by 1 + accepted), and the GDN state after every verified position is kept in
the slot's state positions, so the next step reads position `accepted` (Sequence.state_idx).

Drafts are deterministic (a one-hot draft distribution), so for temperature > 0 the standard
rejection rule reduces to: accept d with probability p(d), else draw from p without d. The
output distribution is the target's. Rows with penalties or logprobs get no drafts.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import numpy as np

from .row import row_of
from .sequence import DRAFT, Sequence

METHODS = ("ngram", "mtp", "self", "scripted")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_drafts: int = 2                 # K - 1: drafts per verify row (K = 1 + num_drafts <= 8)
    ngram_min: int = 1                  # ngram: shortest suffix matched
    ngram_max: int = 4                  # ngram: longest suffix matched
    propose: Callable | None = None     # scripted: propose(seq, max_drafts) -> list[int]
    # mtp: the head's draft vocabulary (FR-Spec; SGLang's speculative_token_map): a JSON file of token ids, the
    # drafts' argmax runs over those columns of the lm_head only. "auto": the checkpoint's draft_token_map.json
    # when it has one; None: the whole vocabulary. Drafts only: verification always uses the full vocabulary.
    token_map: str | None = "auto"

    @classmethod
    def parse(cls, spec) -> "SpeculativeConfig | None":
        if spec is None or isinstance(spec, cls):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative must be a dict like {{'method': 'ngram', 'num_drafts': 2}}, got {spec!r}")
        unknown = set(spec) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative option(s) {sorted(unknown)}")
        cfg = cls(**spec)
        if cfg.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {cfg.method!r}")
        if not isinstance(cfg.num_drafts, int) or not 1 <= cfg.num_drafts <= 7:
            raise ValueError(f"num_drafts must be an integer in 1..7, got {cfg.num_drafts!r}")
        if not 1 <= cfg.ngram_min <= cfg.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if cfg.token_map is not None and not isinstance(cfg.token_map, str):
            raise ValueError(f"token_map must be a path to a JSON list of token ids, 'auto' or null, got {cfg.token_map!r}")
        if cfg.token_map not in ("auto", None) and cfg.method != "mtp":
            raise ValueError(f"token_map restricts the MTP head's drafts; method {cfg.method!r} has none")
        if cfg.method == "scripted" and cfg.propose is None:
            raise ValueError("the scripted proposer needs propose(seq, max_drafts)")
        return cfg

    @classmethod
    def from_cli(cls, text: str | None) -> "SpeculativeConfig | None":
        """'ngram', 'ngram:3' or a JSON object -> a config (None for None / '')."""
        if not text:
            return None
        if text.lstrip().startswith("{"):
            import json
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON: {e}") from None
        else:
            method, _, k = text.partition(":")
            spec = {"method": method}
            if k:
                if not k.isdigit():
                    raise ValueError(f"NUM_DRAFTS must be an integer, got {k!r}")
                spec["num_drafts"] = int(k)
        if spec.get("method") == "scripted":
            raise ValueError("the scripted proposer is programmatic only")
        return cls.parse(spec)


TOKEN_MAP_FILE = "draft_token_map.json"


def load_token_map(spec: SpeculativeConfig | None, model_dir: str, vocab_size: int) -> np.ndarray | None:
    """The MTP head's draft vocabulary as int32 token ids (None: the whole vocabulary), from spec.token_map
    ("auto": model_dir's draft_token_map.json if present). ValueError names a bad file or id."""
    if spec is None or spec.method != "mtp" or spec.token_map is None:
        return None
    path = spec.token_map
    if path == "auto":
        path = os.path.join(model_dir, TOKEN_MAP_FILE)
        if not os.path.exists(path):
            return None
    try:
        with open(path) as f:
            ids = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"token_map {path!r}: {e}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"token_map {path!r} must hold a non-empty JSON list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token_map {path!r}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"token_map {path!r} lists a token id twice")
    return np.asarray(ids, np.int32)


def wants_drafts(seq: Sequence) -> bool:
    """Rows whose token needs penalties, logit adjustments (logit_bias, allowed_token_ids, bad_words,
    min_tokens) or logprobs are decoded plainly (sampler.verify applies none of them)."""
    p = seq.params
    return p.logprobs is None and not p.penalised and not p.adjusts_logits


class Proposer:
    """Drafts for a batch of decoding sequences: `propose` returns up to max_drafts[i] tokens for
    seqs[i]. (No proposer keeps state that needs trimming: the MTP head's KV is rewritten by the
    next step's catch-up, see models/mtp.py.) on_device: its drafts are made and kept on the device
    (the host proposes steps.DRAFT placeholders), so its verify steps may overlap (async scheduling)."""
    on_device = False

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from ngram_max down to ngram_min) and propose the tokens that followed it."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seqs, max_drafts):
        return [self.lookup(s.prompt_ids + s.output_ids, k) for s, k in zip(seqs, max_drafts)]

    def lookup(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        n_ctx = len(context)
        for n in range(min(self.ngram_max, n_ctx - 1), self.ngram_min - 1, -1):
            suffix = context[n_ctx - n:]
            for start in range(n_ctx - n - 1, -1, -1):          # most recent earlier occurrence first
                if context[start:start + n] == suffix:
                    return context[start + n:start + n + k]
        return []


class DeviceProposer(Proposer):
    """Drafts made on the device by the step that emitted the sequence's last token (steps.py): the
    checkpoint's MTP head (models/mtp.py), or prompt lookup over the device's token history
    (device_ngram.py). They stay there (EngineState.last_drafts): the host proposes placeholders
    (steps.DRAFT), Sequence.device_drafts of them at most; the verify step feeds the valid ones."""
    on_device = True

    def propose(self, seqs, max_drafts):
        return [[DRAFT] * min(k, s.device_drafts) for s, k in zip(seqs, max_drafts)]


class SelfProposer(Proposer):
    """Self-speculative: the target model without its recurrent layers drafts greedily (one
    compiled draft step for the whole batch, dispatched before the verify step; engine/steps.self_draft_step).
    Its drafts stay on the device (EngineState.last_drafts), like MTP's."""
    on_device = True

    def __init__(self, engine):
        self.engine = engine

    def propose(self, seqs, max_drafts):
        if not any(max_drafts):
            return [[] for _ in seqs]
        self.engine.runner.self_draft([row_of(s, 1) for s in seqs], max_drafts, [draft_room(s) for s in seqs])
        return [[DRAFT] * k for k in max_drafts]


class ScriptedProposer(Proposer):
    """Drafts from a function propose(seq, max_drafts) -> list[int] (tests, experiments)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def propose(self, seqs, max_drafts):
        return [list(self.fn(s, k))[:k] if k > 0 else [] for s, k in zip(seqs, max_drafts)]


def make_proposer(spec: SpeculativeConfig, engine) -> Proposer:
    """The drafter of `spec` for an EngineCore (refused where the model cannot serve it)."""
    if spec.method == "mtp":
        if not engine.runner.state.draft_kv:
            raise ValueError("speculative method 'mtp' needs a checkpoint with mtp.* tensors (none were loaded)")
        return DeviceProposer()
    if spec.method == "ngram":
        return DeviceProposer() if engine.config.ngram_on_device else NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "self":
        if not engine.cfg.recurrent_layers:
            raise ValueError("speculative method 'self' drafts with the attention layers only; this model has "
                             "no recurrent layers to skip")
        return SelfProposer(engine)
    if spec.method == "scripted":
        return ScriptedProposer(spec.propose)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")


def draft_caps(seqs: list[Sequence], num_drafts: int, lookahead: Callable[[Sequence, int], int]) -> list[int]:
    """Drafts each decoding sequence may get: num_drafts, capped by the tokens the request may still
    emit (a verify emits up to drafts + 1) and by the pages `lookahead` can have without preempting. A
    row still feeding its prompt's last token gets none: the first token always comes from a plain
    sample, however the prompt was chunked or served from the prefix cache, so a seeded request's
    random stream never depends on that."""
    caps = []
    for s in seqs:
        cap = min(num_drafts, draft_room(s)) if wants_drafts(s) and s.num_generated else 0
        if cap > 0:                  # (a row behind its verify in flight: pages for the most that may accept)
            ahead = s.num_cached + s.slack + 1
            cap = min(cap, lookahead(s, ahead + cap) - ahead)
        caps.append(max(cap, 0))
    return caps


def draft_room(seq: Sequence) -> int:
    """Drafts seq's next row may verify before its length limit, counting none of its slack as accepted
    (steps.chase subtracts what was)."""
    return seq.max_len - seq.num_tokens - 1


@dataclasses.dataclass
class SpecStats:
    verify_steps: int = 0        # target steps that verified drafts
    rows: int = 0                # verify rows that carried drafts
    drafted: int = 0             # draft tokens fed
    accepted: int = 0            # draft tokens accepted
    emitted: int = 0             # tokens emitted by rows with drafts (accepted + 1 each)
    accepted_hist: dict = dataclasses.field(default_factory=dict)    # accepted count -> rows
    decode_row_steps: int = 0    # decoding rows over all decode / verify steps, drafts or not
    decode_tokens: int = 0       # tokens those rows emitted
    drafted_at: list = dataclasses.field(default_factory=list)     # [j]: rows that carried a j-th draft
    accepted_at: list = dataclasses.field(default_factory=list)    # [j]: rows whose j-th draft was accepted

    def record_decode(self, rows: int, tokens: int) -> None:
        self.decode_row_steps += rows
        self.decode_tokens += tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.rows += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.emitted += num_accepted + 1
        self.accepted_hist[num_accepted] = self.accepted_hist.get(num_accepted, 0) + 1
        for counts, n in ((self.drafted_at, num_drafted), (self.accepted_at, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    def summary(self) -> dict:
        return {"verify_steps": self.verify_steps, "rows": self.rows, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "mean_accepted_length": self.emitted / self.rows if self.rows else None,
                "tokens_per_target_step": self.decode_tokens / self.decode_row_steps if self.decode_row_steps else None,
                "accepted_hist": dict(sorted(self.accepted_hist.items())),
                # P(draft j accepted | drafted): j = 0 is the first-draft acceptance rate
                "acceptance_by_position": [round((self.accepted_at[j] if j < len(self.accepted_at) else 0) / d, 4)
                                           for j, d in enumerate(self.drafted_at)]}
