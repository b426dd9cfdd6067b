"""`python -m atlas_jax.serve`: an OpenAI-compatible HTTP server on the engine.

    python -m atlas_jax.serve [--model PATH] [--host 127.0.0.1] [--port 8000] [...]
With no --model it serves the embedded default model. The port opens at once; the engine thread
compiles every step shape first, and /health answers 503 (Retry-After) until that is done, so a
200 means serving compiles nothing more.
SIGINT / SIGTERM: stop accepting, abort what is in flight, exit 0.
"""
from __future__ import annotations

import argparse
import logging
import os

from .engine.speculative import SpeculativeConfig
from .kernels import KERNELS


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m atlas_jax.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    ap.add_argument("--served-model-name", default=None, help="model id clients use (default: the checkpoint dir name)")
    ap.add_argument("--api-key", default=os.environ.get("ATLAS_JAX_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $ATLAS_JAX_API_KEY, else none)")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on accelerators, fp32 on CPU), bfloat16, float32")
    ap.add_argument("--kernels", default="auto", choices=KERNELS, help="attention / GDN implementation")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="running sequences (= recurrent-state slots)")
    ap.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per request")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool (default: every slot can reach "
                    "max-model-len)")
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="KV pool size in GiB (instead of --num-pages)")
    ap.add_argument("--max-prefill-chunk", type=int, default=256, help="prompt tokens per sequence per step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    ap.add_argument("--preemption-mode", default="swap", choices=["swap", "recompute"])
    ap.add_argument("--chat-template", default=None, help="jinja2 chat template: a file or the template text")
    ap.add_argument("--request-timeout", type=float, default=None, help="seconds; a request running longer ends "
                    "with finish_reason 'timeout'")
    ap.add_argument("--max-waiting", type=int, default=256, help="requests in flight before 503 + Retry-After")
    ap.add_argument("--speculative", default=None, help="speculative decoding: METHOD[:NUM_DRAFTS] (mtp, self, "
                    "ngram; e.g. 'mtp:2') or a JSON object {\"method\": ..., \"num_drafts\": ...}")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        speculative = SpeculativeConfig.from_cli(args.speculative)
    except ValueError as e:
        raise SystemExit(f"--speculative: {e}") from None
    import uvicorn

    from .engine.async_llm import AsyncLLM
    from .engine.llm import LLM
    from .server.app import build_app

    logging.basicConfig(level=args.log_level.upper())
    num_pages = args.num_pages
    llm_kwargs = dict(dtype=args.dtype, kernels=args.kernels, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, max_prefill_chunk=args.max_prefill_chunk,
                      max_num_batched_tokens=args.max_num_batched_tokens, preemption_mode=args.preemption_mode,
                      speculative=speculative)
    if args.kv_cache_memory is not None and num_pages is None:
        num_pages = _pages_for_memory(args, llm_kwargs)
    llm = LLM(args.model, num_pages=num_pages, warmup=False, **llm_kwargs)
    engine = AsyncLLM.from_llm(llm, warmup=True)       # compiles in the engine thread; /health is 503 until done
    name = args.served_model_name or os.path.basename(os.path.normpath(llm.model_path))
    app = build_app(engine, served_model_name=name, api_key=args.api_key, chat_template=args.chat_template,
                    request_timeout=args.request_timeout, max_waiting=args.max_waiting)

    logging.getLogger("atlas_jax").info("serving %s on http://%s:%d (warming up; /health is 503 until ready)",
                                        name, args.host, args.port)
    server = _GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                            timeout_graceful_shutdown=10))
    try:
        server.run()          # returns after SIGINT / SIGTERM: no new connections, open ones drained
    finally:
        engine.shutdown()     # abort whatever is still in flight, stop the engine thread


class _GracefulServer:
    """uvicorn.Server that treats SIGINT / SIGTERM as a request to shut down and exit 0 (uvicorn
    re-raises the captured signal after its graceful shutdown, which would end the process by it)."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                super().handle_exit(sig, frame)
                self._captured_signals.clear()
        return Server(config)


def _pages_for_memory(args, llm_kwargs) -> int:
    """Pages that fit in --kv-cache-memory GiB for this model."""
    from .config import ModelConfig
    from .engine.llm import resolve_dtype
    from .state.cache import state_bytes
    if args.model is None:
        from .default_model import default_model_path
        args.model = default_model_path()
    cfg = ModelConfig.from_pretrained(args.model)
    dtype = resolve_dtype(args.dtype)
    per_page = state_bytes(cfg, 2, args.page_size, 1, dtype) - state_bytes(cfg, 1, args.page_size, 1, dtype)
    return max(1, int(args.kv_cache_memory * 2**30 // max(per_page, 1)))


if __name__ == "__main__":
    main()
