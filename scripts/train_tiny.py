"""Train atlas-tiny: a small Qwen3-Next (GDN + gated attention + MoE with a shared expert + an MTP
head) on the Python standard library's own source, and export it as an HF-format checkpoint.

The forward is the engine's own (`models.decoder.forward` over a fresh state, `models.mtp.mtp_forward`
for the head): one prefill segment of [batch, seq] tokens, so training and serving run the same math.
Loss = CE(next token) + mtp_weight * CE(token after next through the MTP head), as Qwen3-Next's MTP is
trained. Data: files split by a hash of their path (held out: 1 in 20); the training stream is the
tokenized files joined by <|endoftext|>; batches are windows drawn from a seeded RNG keyed by step, so
a resumed run (orbax checkpoints every --ckpt-every steps) sees exactly the batches it would have.

Stage 2 (`--head-from CKPT`) trains only the MTP head of an exported checkpoint (the main model frozen, so
its outputs and held-out numbers stay bit for bit), chained over --mtp-depths as the draft loop chains it,
optionally distilled from the main model's own distribution (--distill: a draft is judged by the model).

  python scripts/train_tiny.py --out /tmp/atlas-tiny --minutes 55      # train + export
  python scripts/train_tiny.py --out /tmp/atlas-tiny --eval-only       # held-out numbers of the export
  python scripts/train_tiny.py --out /tmp/atlas-tiny-2 --head-from /tmp/atlas-tiny --mtp-depths 3 --distill \
      --steps 190 --warmup 10 --lr 1e-3                              # stage 2: the head (~8 minutes)
Prints one JSON object at the end (held-out loss, bits per byte, throughput, completions).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CONFIG = {  # config.json (vocab and special ids are added from the tokenizer)
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "full_attention_interval": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
    "shared_expert_intermediate_size": 256, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "num_nextn_predict_layers": 1, "torch_dtype": "float32",
}


# ---------------------------------------------------------------- data

def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def python_files(root: str, skip=("site-packages", "dist-packages")) -> list[str]:
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if not any(f"{os.sep}{s}{os.sep}" in f for s in skip)]


def is_held_out(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % 20 == 0


def read_texts(files: list[str]) -> list[str]:
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    return texts


def corpus_splits(max_files: int | None = None) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts) of the interpreter's standard library (max_files: a spread subset)."""
    root = stdlib_dir()
    files = python_files(root)
    if max_files:
        files = files[::max(1, len(files) // max_files)]
    train = [f for f in files if not is_held_out(os.path.relpath(f, root))]
    held = [f for f in files if is_held_out(os.path.relpath(f, root))]
    return read_texts(train), read_texts(held)


def outside_texts() -> list[str]:
    """Python code from outside the standard library: the pinned jinja2 package's source."""
    import jinja2
    return read_texts(python_files(os.path.dirname(jinja2.__file__), skip=()))


def train_tokenizer(texts: list[str], vocab_size: int):
    from atlas_jax.default_model import train_byte_bpe
    return train_byte_bpe(texts, vocab_size, SPECIAL_TOKENS)


def token_stream(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def batch_at(stream: np.ndarray, step: int, batch: int, width: int, seed: int) -> np.ndarray:
    """The step's [batch, width] windows (a pure function of (seed, step): resumable)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - width, size=batch)
    return np.stack([stream[s:s + width] for s in starts])


# ---------------------------------------------------------------- model

def init_params(cfg, seed: int):
    """Fresh params in the engine's tree layout: linears ~ N(0, 1/fan_in) (output projections scaled by
    1/sqrt(2 * layers)), zero-centred norms at 0 (scale 1), GDN gates as Qwen3-Next initialises them."""
    import jax.numpy as jnp

    from atlas_jax.models import family
    from atlas_jax.models.layout import as_lists, set_path

    rng = np.random.default_rng(seed)
    out_scale = (2 * (cfg.num_layers + 1)) ** -0.5
    tree: dict = {}
    for spec in family(cfg.model_type).param_specs(cfg, mtp_layers=1):
        name, shape = spec.path[-1], spec.shape
        if name == "A_log":
            value = np.log(rng.uniform(1.0, 16.0, shape))
        elif name == "dt_bias" or (name == "norm" and "gdn" in spec.path):
            value = np.ones(shape)
        elif "norm" in str(name):
            value = np.zeros(shape)
        elif name == "embed":
            value = rng.standard_normal(shape) * 0.02
        elif name == "conv":
            value = rng.standard_normal(shape) * shape[-1] ** -0.5
        else:
            fan_in = shape[-2]
            value = rng.standard_normal(shape) * fan_in ** -0.5
            if name in ("o", "out", "down"):
                value *= out_scale
        set_path(tree, spec.path, jnp.asarray(value, jnp.float32))
    return as_lists(tree)


def make_loss(cfg, batch: int, seq: int, mtp_weight: float, page_size: int = 16, mtp_depths: int = 1,
              distill: bool = False):
    """loss(params, windows [batch, seq + 1 + mtp_depths]) -> (total, (main CE, MTP CE [mtp_depths], MTP
    agreement [mtp_depths])); CE in nats per token. Depth d of the head sees the token d after each position
    and, for d > 1, its own output hidden state of depth d - 1 (as drafting chains it), and predicts the token
    d + 1 after; each depth attends causally over its own pass's KV (the draft loop's keys before the draft
    position come from depth 1: an approximation, as DeepSeek-V3's MTP modules train). Agreement: how often
    the head's argmax is the main model's argmax at that position (what greedy verification accepts).
    total = main + mtp_weight * the mean over depths of the head's CE against the data, or with `distill`
    against the main model's own distribution there (self-distillation: drafts are judged by the model, not
    by the data)."""
    import jax
    import jax.numpy as jnp
    import optax

    from atlas_jax.batch import StepBatch
    from atlas_jax.models.decoder import forward, lm_head
    from atlas_jax.models.mtp import init_mtp_kv, mtp_forward
    from atlas_jax.state.cache import init_state

    pages = -(-seq // page_size)

    def ce(logits, targets):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def loss(params, windows):
        seg = StepBatch(tokens=windows[:, :seq], q_len=jnp.full((batch,), seq, jnp.int32),
                        start=jnp.zeros((batch,), jnp.int32),
                        block_table=jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages),
                        slot=jnp.arange(batch, dtype=jnp.int32), state_idx=jnp.zeros((batch,), jnp.int32))
        state = init_state(cfg, batch * pages, page_size, batch, jnp.float32)
        (logits,), hidden, _ = forward(params, state, (seg,), cfg, all_logits=True, all_hidden=True)
        main = ce(logits, windows[:, 1:seq + 1])
        mtp, agree, soft = [], [], []
        for d in range(1, mtp_depths + 1):      # RoPE is relative: depth d's positions need no shift
            kv = init_mtp_kv(cfg, 1, batch * pages, page_size, jnp.float32)
            hidden, _ = mtp_forward(params, kv, (seg,), windows[:, d:seq + d].reshape(-1), hidden, cfg)
            head = lm_head(params, hidden, cfg).reshape(batch, seq, -1)
            mtp.append(ce(head, windows[:, d + 1:seq + d + 1]))
            judge = jax.lax.stop_gradient(logits[:, d:])      # the main model at p + d: [batch, seq - d, V]
            agree.append(jnp.mean(jnp.argmax(head[:, :seq - d], -1) == jnp.argmax(judge, -1)))
            if distill:
                soft.append(jnp.mean(optax.softmax_cross_entropy(head[:, :seq - d].astype(jnp.float32),
                                                                 jax.nn.softmax(judge.astype(jnp.float32), -1))))
        mtp, agree = jnp.stack(mtp), jnp.stack(agree)
        objective = jnp.mean(jnp.stack(soft)) if distill else jnp.mean(mtp)
        return main + mtp_weight * objective, (main, mtp, agree)

    return loss


def head_only(loss_fn, frozen):
    """loss over the MTP head's params alone (the rest of `frozen` held fixed: the main model's outputs do
    not change, so neither do its held-out numbers): head_loss(mtp_params, windows)."""
    def head_loss(mtp_params, windows):
        return loss_fn({**frozen, "mtp": mtp_params}, windows)
    return head_loss


# ---------------------------------------------------------------- export

def write_token_map(out: str, train_stream: np.ndarray, size: int) -> None:
    """The MTP head's draft vocabulary (FR-Spec): the `size` most frequent tokens of the training stream
    (ties by id), as engine/speculative.py's draft_token_map.json."""
    from atlas_jax.engine.speculative import TOKEN_MAP_FILE
    counts = np.bincount(train_stream, minlength=int(train_stream.max()) + 1)
    ids = np.argsort(-counts, kind="stable")[:size]
    with open(os.path.join(out, TOKEN_MAP_FILE), "w") as f:
        json.dump(sorted(int(t) for t in ids), f)


def export(out: str, params, config: dict, tok) -> None:
    """Write the HF-format checkpoint: config.json, model.safetensors (incl. mtp.*), tokenizer files
    (the model card, README.md, is written by hand from the run's JSON and scripts/eval_tiny.py's)."""
    from safetensors.numpy import save_file

    from atlas_jax.config import ModelConfig
    from atlas_jax.models import family
    from atlas_jax.models.layout import hf_tensors

    cfg = ModelConfig.from_dict(config)
    tensors = hf_tensors(params, family(cfg.model_type).param_specs(cfg, mtp_layers=1))
    os.makedirs(out, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos, tok.token_to_id("<|im_end|>")]}, f, indent=2)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
                   "additional_special_tokens": SPECIAL_TOKENS[1:],
                   "model_max_length": config["max_position_embeddings"]}, f, indent=2)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)


# ---------------------------------------------------------------- evaluation

def evaluate(loss_fn, params, stream: np.ndarray, texts: list[str], batch: int, seq: int,
             max_tokens: int | None = None, mtp_depths: int = 1) -> dict:
    """Mean next-token CE over non-overlapping windows covering `stream` (the last partial batch dropped;
    at most max_tokens scored), and bits per byte = CE / (ln 2 * the stream's UTF-8 bytes per token);
    mtp_loss: the head's CE at depth 1 (by_depth: at each depth when mtp_depths > 1)."""
    width = seq + 1 + mtp_depths
    n_windows = (len(stream) - 2) // seq
    n_batches = max(1, n_windows // batch)
    if max_tokens:
        n_batches = max(1, min(n_batches, max_tokens // (batch * seq)))
    main, mtp, agree = 0.0, np.zeros(mtp_depths), np.zeros(mtp_depths)
    for b in range(n_batches):
        rows = [stream[(b * batch + i) * seq:(b * batch + i) * seq + width] for i in range(batch)]
        rows = [np.pad(r, (0, width - len(r))) for r in rows]
        _, (m, t, a) = loss_fn(params, np.stack(rows))
        main += float(m)
        mtp += np.asarray(t)
        agree += np.asarray(a)
    main, mtp, agree = main / n_batches, mtp / n_batches, agree / n_batches
    tokens_scored = n_batches * batch * seq
    bytes_per_token = sum(len(t.encode()) for t in texts) / len(stream)
    out = {"loss": round(main, 4), "mtp_loss": round(float(mtp[0]), 4), "tokens": tokens_scored,
           "bytes_per_token": round(bytes_per_token, 3), "bits_per_byte": round(main / math.log(2) / bytes_per_token, 4)}
    out["mtp_agreement_by_depth"] = [round(float(a), 4) for a in agree]
    if mtp_depths > 1:
        out["mtp_loss_by_depth"] = [round(float(m), 4) for m in mtp]
    return out


# ---------------------------------------------------------------- main

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="export directory (the HF-format checkpoint)")
    ap.add_argument("--work", default=None, help="orbax checkpoints + tokenized corpus (default: OUT.work)")
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4000, help="schedule length (the cosine decays over it)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--mtp-depths", type=int, default=1, help="train the head on this many chained depths: depth "
                    "d > 1 reads its own depth d - 1 output, as the draft loop does")
    ap.add_argument("--distill", action="store_true", help="train the head on the main model's distribution at "
                    "each position instead of the data's next tokens")
    ap.add_argument("--head-from", default=None, metavar="CKPT", help="stage 2: train only the MTP head of the "
                    "HF checkpoint CKPT (its tokenizer and config; the main model frozen) and export it to OUT")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--token-map", type=int, default=1024, metavar="N", help="the MTP head's draft vocabulary "
                    "written beside the checkpoint: the N most frequent training tokens (0: none)")
    ap.add_argument("--token-map-only", action="store_true", help="write only OUT's draft_token_map.json (with "
                    "OUT's tokenizer) and stop")
    ap.add_argument("--config", default=None, help="JSON overrides of the model config (tests: a tinier model)")
    ap.add_argument("--max-files", type=int, default=None, help="train on a spread subset of the files (tests)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="score at most this many tokens per split")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from atlas_jax.config import ModelConfig

    train_texts, held_texts = corpus_splits(args.max_files)
    if args.token_map_only:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json"))
        write_token_map(args.out, token_stream(tok, train_texts), args.token_map)
        return {}
    work = os.path.abspath(args.work or args.out.rstrip("/") + ".work")
    os.makedirs(work, exist_ok=True)
    tok_path = os.path.join(args.head_from or work, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
    else:
        tok = train_tokenizer(train_texts, args.vocab)
        tok.save(tok_path)
    stream_path = os.path.join(work, "train_tokens.npy")
    if os.path.exists(stream_path):
        train_stream = np.load(stream_path)
    else:
        train_stream = token_stream(tok, train_texts)
        np.save(stream_path, train_stream)
    held_stream = token_stream(tok, held_texts)
    outside = outside_texts()
    outside_stream = token_stream(tok, outside)

    if args.head_from:
        with open(os.path.join(args.head_from, "config.json")) as f:
            config = json.load(f)
    else:
        config = {**CONFIG, **json.loads(args.config or "{}"), "vocab_size": tok.get_vocab_size(),
                  "eos_token_id": tok.token_to_id("<|endoftext|>"), "bos_token_id": None,
                  "pad_token_id": tok.token_to_id("<|endoftext|>")}
    cfg = ModelConfig.from_dict(config)
    loss_fn = make_loss(cfg, args.batch, args.seq, args.mtp_weight, mtp_depths=args.mtp_depths,
                        distill=args.distill)
    eval_loss = jax.jit(loss_fn)
    if args.head_from:            # stage 2: its own checkpoints and batches (seed + 1: windows stage 1 did not draw)
        from atlas_jax.weights import load_model_params
        model, _ = load_model_params(args.head_from, cfg, jnp.float32)
        frozen = {k: v for k, v in model.items() if k != "mtp"}
        train_loss = head_only(loss_fn, frozen)
        data_seed, ckpt_dir = args.seed + 1, os.path.join(work, "ckpt_head")
    else:
        train_loss, data_seed, ckpt_dir = loss_fn, args.seed, os.path.join(work, "ckpt")

    warmup = min(args.warmup, args.steps // 10 + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps + 1, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1,
                                  mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)))

    @jax.jit
    def train_step(params, opt_state, windows):
        (total, (main, mtp, _)), grads = jax.value_and_grad(train_loss, has_aux=True)(params, windows)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, main, mtp

    params = model["mtp"] if args.head_from else init_params(cfg, args.seed)
    opt_state = opt.init(params)
    mngr = ocp.CheckpointManager(ckpt_dir,
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1))
    step = 0
    trained_s = 0.0
    if mngr.latest_step() is not None:
        like = {"params": params, "opt_state": opt_state, "trained_s": np.zeros((), np.float64)}
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(like))
        params, opt_state = restored["params"], restored["opt_state"]
        step, trained_s = mngr.latest_step(), float(restored["trained_s"])
        print(f"resumed at step {step} ({trained_s / 60:.1f} min trained)", file=sys.stderr)

    def save(at):
        mngr.save(at, args=ocp.args.StandardSave(
            {"params": params, "opt_state": opt_state, "trained_s": np.asarray(trained_s)}), force=True)

    width = args.seq + 1 + args.mtp_depths
    if not args.eval_only and step < args.steps:
        bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True)
        t_last, tokens_since = time.perf_counter(), 0
        while step < args.steps and (args.minutes is None or trained_s < args.minutes * 60):
            windows = jnp.asarray(batch_at(train_stream, step, args.batch, width, data_seed))
            t0 = time.perf_counter()
            params, opt_state, main, mtp = train_step(params, opt_state, windows)
            main, mtp = float(main), float(np.mean(mtp))
            trained_s += time.perf_counter() - t0
            step += 1
            tokens_since += args.batch * args.seq
            if not math.isfinite(main):
                raise FloatingPointError(f"loss is {main} at step {step}")
            now = time.perf_counter()
            bar.set_postfix(loss=f"{main:.3f}", mtp=f"{mtp:.3f}", tok_s=f"{tokens_since / (now - t_last):.0f}")
            bar.update(1)
            if step % args.ckpt_every == 0:
                save(step)
                t_last, tokens_since = time.perf_counter(), 0
        bar.close()
        if mngr.latest_step() != step:
            save(step)
    mngr.wait_until_finished()
    if args.head_from:
        params = {**frozen, "mtp": params}
    n_params = sum(a.size for a in jax.tree.leaves(params))
    report = {
        "params": int(n_params), "steps": step, "train_tokens": step * args.batch * args.seq,
        "train_minutes": round(trained_s / 60, 1), "corpus": f"Python {sys.version.split()[0]} Lib/ "
        f"({len(train_texts)} train / {len(held_texts)} held-out files)",
        "train_stream_tokens": int(len(train_stream)),
        "held_out": evaluate(eval_loss, params, held_stream, held_texts, args.batch, args.seq, args.eval_tokens,
                             args.mtp_depths),
        "outside_stdlib": evaluate(eval_loss, params, outside_stream, outside, args.batch, args.seq,
                                   args.eval_tokens, args.mtp_depths),
    }
    export(args.out, jax.tree.map(np.asarray, params), config, tok)
    if args.token_map:
        write_token_map(args.out, train_stream, args.token_map)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
