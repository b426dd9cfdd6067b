"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on AsyncLLM; `python -m atlas_jax.serve`."""
