"""POST /tokenize and /detokenize (the names and shapes of vLLM's and llama.cpp's servers): the ids
the model reads for a prompt or for chat messages, and the text of ids. They run on an engine, which
holds the tokenizer and the chat template; the counts are the ones a request's usage reports
(`prompt_tokens` of a completion, or of a chat on a new session). With API keys they need one."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request

from ..deps import service, tenant
from ..protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter(dependencies=[Depends(tenant)])


async def on_engine(request: Request, model: str, job: dict) -> dict:
    """The job's end event, run on an engine (any: no session is written)."""
    svc = service(request)
    svc.check_model(model)
    return await svc.manage({**job, "session": f"tokens-{uuid.uuid4().hex}"})


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    job = {"kind": "tokenize", "prompt": body.prompt, "add_special_tokens": body.add_special_tokens,
           "messages": [m.plain() for m in body.messages] if body.messages is not None else None,
           "add_generation_prompt": body.add_generation_prompt}
    end = await on_engine(request, body.model, job)
    return {"count": len(end["tokens"]), "max_model_len": end["max_model_len"], "tokens": end["tokens"],
            "token_strs": None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    end = await on_engine(request, body.model, {"kind": "detokenize", "tokens": body.tokens})
    return {"prompt": end["prompt"]}
