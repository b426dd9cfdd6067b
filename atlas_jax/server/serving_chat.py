"""POST /v1/chat/completions: messages rendered with the chat template, replies parsed into content,
reasoning_content and tool_calls (parsers.py), streamed or not."""
from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..frontend.tokenizer import check_unicode
from .guard import JSON, APIError
from ..frontend.parsers import THINK_END, THINK_START, Delta, OutputParser, forced_opening
from .protocol import ChatCompletionRequest
from .streams import DONE, ServerContext, guarded, logprob, prompt_count, sse, usage


def render_chat(ctx: ServerContext, body) -> str:
    """The prompt text of a chat body (also /tokenize's)."""
    for i, m in enumerate(body.messages):
        check_unicode(m.text(), f"messages.{i}.content")
    inputs = body.template_inputs()
    return ctx.template.render(inputs.pop("messages"), **inputs)


def finish_reason(reason, calls):
    """OpenAI reports a reply that ends in tool calls as finish_reason "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    engine = ctx.engine

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, lora = await ctx.admit(request, ChatCompletionRequest)
        top = (body.top_logprobs or 0) if body.logprobs else None
        cap = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(cap, top)
        prompt = await engine.offload(render_chat, ctx, body)
        fmt = ctx.tool_format if body.tools and body.tool_choice != "none" else "none"
        if fmt == "none" and body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "this model's chat template has no tool-call format; start the server with "
                                "--tool-call-parser to force tool calls", param="tool_choice")
        opened = ctx.reasoning != "none" and prompt.rstrip().endswith(THINK_START)
        forced = forced_opening(fmt, body.tool_choice)       # the reply's head the server writes
        if forced and opened:
            forced = THINK_END + "\n\n" + forced
        prompt += forced

        def parser():
            return OutputParser(fmt, body.tools, ctx.reasoning, opened, prefix=forced)

        def keep(calls):
            return calls if body.parallel_tool_calls else calls[:1]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "created": int(time.time()), "model": lora or ctx.model_name}
        items = await ctx.started(request, [prompt], params, rid, lora)

        def tok(t):
            s = ctx.token_text(t)
            return {"token": s, "bytes": list(s.encode())}

        def chat_logprobs(token_ids, lps):
            if lps is None:
                return None
            return {"content": [{**tok(t), "logprob": logprob(lp[t]),
                                 "top_logprobs": [{**tok(k), "logprob": logprob(v)} for k, v in
                                                  sorted(lp.items(), key=lambda kv: -kv[1])[:body.top_logprobs or 0]]}
                                for lp, t in zip(lps, token_ids)]}

        if body.stream:
            async def events():
                sent_role, completion, prompt_tokens = set(), 0, (0, 0)
                parsers, calls = {}, {}
                async for _, out in items:
                    prompt_tokens = prompt_count(out)
                    for c in out.outputs:
                        completion += len(c.token_ids)
                        p = parsers.setdefault(c.index, parser())
                        parsed = p.feed(c.text)
                        if c.finished:
                            tail = p.finish()
                            parsed = Delta(parsed.content + tail.content, parsed.reasoning + tail.reasoning,
                                           parsed.tool_calls + tail.tool_calls)
                        delta = {}
                        if c.index not in sent_role:
                            delta["role"] = "assistant"
                            sent_role.add(c.index)
                        if parsed.reasoning:
                            delta["reasoning_content"] = parsed.reasoning
                        if parsed.content:
                            delta["content"] = parsed.content
                        made = calls.setdefault(c.index, [])
                        new = keep(made + parsed.tool_calls)[len(made):]
                        if new:
                            delta["tool_calls"] = [{"index": len(made) + j, **call.to_openai()} for j, call in enumerate(new)]
                            made += new
                        if not delta and not c.finished and c.logprobs is None:
                            continue
                        yield sse({**head, "object": "chat.completion.chunk", "choices": [{
                            "index": c.index, "delta": delta, "logprobs": chat_logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish_reason(c.finish_reason, made), "stop_reason": c.stop_reason}]})
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                               "usage": usage([prompt_tokens], completion)})
                yield DONE
            return StreamingResponse(guarded(events()), media_type="text/event-stream")

        choices, prompt_tokens = await ctx.collect(items, 1)

        def message(text):
            d = parser().parse(text)
            calls = keep(d.tool_calls)
            msg = {"role": "assistant", "content": d.content if d.content or not calls else None}
            if ctx.reasoning != "none":
                msg["reasoning_content"] = d.reasoning or None
            if calls:
                msg["tool_calls"] = [call.to_openai() for call in calls]
            return msg, calls

        def response():
            out = []
            for i, ch in choices.items():
                msg, calls = message(ch.text)
                out.append({"index": i, "message": msg, "logprobs": chat_logprobs(ch.token_ids, ch.logprobs),
                            "finish_reason": finish_reason(ch.finish_reason, calls), "stop_reason": ch.stop_reason})
            completion = sum(len(ch.token_ids) for ch in choices.values())
            first = next(iter(choices.values()), None)
            extra = {"prompt_logprobs": first.prompt_logprobs} if first and first.prompt_logprobs is not None else {}
            return {**head, "object": "chat.completion", "choices": out, "usage": usage(prompt_tokens, completion),
                    **extra}
        return await engine.offload(lambda: JSON(response()))       # rendered off the event loop too
