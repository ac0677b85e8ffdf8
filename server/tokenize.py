"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, and ``GET /version``.

``/tokenize`` takes ``{"model", "prompt"}`` (tokenized as ``/v1/completions`` would, special
tokens added unless ``add_special_tokens`` is false) or ``{"model", "messages"}`` (rendered
through the chat template as ``/v1/chat/completions`` would, generation prompt included) and
answers ``{"tokens", "count", "max_model_len"}``; ``/detokenize`` takes ``{"model", "tokens"}``
and answers ``{"prompt"}``. Both go through the same :class:`JobBuilder` as generation, so the
count is exactly what a generation request's ``usage.prompt_tokens`` would be. ``model`` may be
left out (vLLM allows it).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import from_json

from splitserve.server.errors import APIError, from_validation_errors
from splitserve.server.job_builder import MODEL_ALIAS, JobBuilder
from splitserve.server.offload import Offload
from splitserve.server.protocol import ChatCompletionRequest, CompletionRequest


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = MODEL_ALIAS
    tokens: list[int]


def server_version() -> str:
    """The installed splitserve version (``0+unknown`` when run from an uninstalled tree)."""
    try:
        return version("splitserve")
    except PackageNotFoundError:
        return "0+unknown"


def install_tokenize_routes(app: FastAPI, jobs: JobBuilder, tokenizer: Any,
                            context_len: int, offload: Offload) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/version`` to ``app``; their parsing,
    tokenizing and decoding run on ``offload``'s threads."""

    def prompt_ids(raw: bytes) -> list[int]:
        body = _json_object(raw)
        body.setdefault("model", MODEL_ALIAS)
        model_cls = ChatCompletionRequest if "messages" in body else CompletionRequest
        req = _validate(model_cls, body)
        _check_model(jobs, req.model)
        return jobs.prompt_ids(req)

    def decoded(raw: bytes) -> str:
        req = _validate(DetokenizeRequest, _json_object(raw))
        _check_model(jobs, req.model)
        vocab_size = len(tokenizer)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab_size:
                raise APIError(f"tokens[{i}]: token id {t} is outside the vocabulary",
                               param=f"tokens[{i}]")
        return tokenizer.decode(req.tokens)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        ids = await offload.run(prompt_ids, await request.body())
        return {"tokens": ids, "count": len(ids), "max_model_len": context_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return {"prompt": await offload.run(decoded, await request.body())}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": server_version()}


def _json_object(raw: bytes) -> dict[str, Any]:
    # pydantic's parser, as for generation bodies: it refuses lone surrogates (\ud800), which
    # Python's json accepts and the tokenizer then cannot take.
    try:
        body = from_json(raw)
    except ValueError as exc:
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    return body


def _validate(model_cls: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(), body) from None


def _check_model(jobs: JobBuilder, model: str) -> None:
    jobs.resolve_model(model)  # a LoRA adapter tokenizes as its base model
