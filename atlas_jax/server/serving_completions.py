"""POST /v1/completions: one or more prompts (text or token ids), n completions each, streamed or not."""
from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .guard import JSON, APIError
from .protocol import CompletionRequest
from .streams import DONE, Choice, ServerContext, guarded, logprob, prompt_count, sse, usage

MAX_PROMPTS = 64                    # prompts in one request


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    engine = ctx.engine

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, lora = await ctx.admit(request, CompletionRequest)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        params = body.sampling_params(16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"             # x-request-id stays a header: clients may repeat it
        created, n = int(time.time()), body.n
        items = await ctx.started(request, prompts, params, rid, lora)
        head = {"id": rid, "object": "text_completion", "created": created, "model": lora or ctx.model_name}

        def choice_logprobs(token_ids, lps):
            if lps is None:
                return None
            return {"tokens": [ctx.token_text(t) for t in token_ids],
                    "token_logprobs": [logprob(lp[t]) for lp, t in zip(lps, token_ids)],
                    "top_logprobs": [{ctx.token_text(k): logprob(v) for k, v in lp.items()} for lp in lps],
                    "text_offset": None}

        if body.stream:
            async def events():
                prompt_tokens, completion, sent_prompt, scored = {}, 0, set(), {}
                async for i, out in items:
                    prompt_tokens[i] = prompt_count(out)
                    for c in out.outputs:
                        if not c.text and not c.finished and not c.token_ids:
                            continue
                        completion += len(c.token_ids)
                        choice = {"index": i * n + c.index, "text": c.text,
                                  "logprobs": choice_logprobs(c.token_ids, c.logprobs),
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        if body.return_token_ids:
                            choice["token_ids"] = list(c.token_ids)
                        if out.prompt_logprobs is not None and (i, c.index) not in sent_prompt:
                            if i not in scored:                # converted once per prompt, not per completion
                                scored[i] = await ctx.prompt_logprobs_async(out.prompt_logprobs)
                            choice["prompt_logprobs"] = scored[i]
                            sent_prompt.add((i, c.index))
                            yield await engine.offload(sse, {**head, "choices": [choice]})
                            continue
                        yield sse({**head, "choices": [choice]})
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(prompt_tokens.values(), completion)})
                yield DONE
            return StreamingResponse(guarded(events()), media_type="text/event-stream")

        choices, prompt_tokens = await ctx.collect(items, n)

        def response():
            def one(k, ch: Choice):
                out = {"index": k, "text": ch.text, "logprobs": choice_logprobs(ch.token_ids, ch.logprobs),
                       "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                if ch.prompt_logprobs is not None:
                    out["prompt_logprobs"] = ch.prompt_logprobs
                if body.return_token_ids:
                    out["token_ids"] = ch.token_ids
                return out
            completion = sum(len(ch.token_ids) for ch in choices.values())
            return {**head, "choices": [one(k, ch) for k, ch in choices.items()],
                    "usage": usage(prompt_tokens, completion)}
        return await engine.offload(lambda: JSON(response()))       # rendered off the event loop too
