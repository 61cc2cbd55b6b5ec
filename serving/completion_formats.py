"""The two OpenAI completion formats as the gateway handles them: where an engine answers each, what a choice
holds (text, token ids, log-probs), a withheld choice, and a choice as the client gets it."""

from __future__ import annotations


class _Text:
    path = "/v1/completions"

    @staticmethod
    def extract(choice: dict) -> tuple[str, list[int], list[float]]:
        lp = choice.get("logprobs") or {}
        return choice.get("text") or "", list(choice.get("token_ids") or []), [float(x) for x in lp.get("token_logprobs") or []]

    @staticmethod
    def empty(choice: dict) -> dict:
        """The choice as a withheld completion reaches the client: no text, no tokens."""
        return {**choice, "text": "", "token_ids": [], "logprobs": None, "finish_reason": "stop"}

    @staticmethod
    def for_client(choice: dict, req) -> dict:
        out = {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}
        if req.return_token_ids:
            out["token_ids"], out["prompt_token_ids"] = choice.get("token_ids"), choice.get("prompt_token_ids")
        if not req.logprobs:
            out["logprobs"] = None
        return out


class _Chat:
    path = "/v1/chat/completions"

    @staticmethod
    def extract(choice: dict) -> tuple[str, list[int], list[float]]:
        msg = choice.get("message") or choice.get("delta") or {}
        content = (choice.get("logprobs") or {}).get("content") or []
        return msg.get("content") or "", list(choice.get("token_ids") or []), [float(c["logprob"]) for c in content]

    @staticmethod
    def empty(choice: dict) -> dict:
        """The choice as a withheld completion reaches the client: an empty message."""
        message = {**(choice.get("message") or {}), "content": ""}
        return {**choice, "message": message, "token_ids": [], "logprobs": None, "finish_reason": "stop"}

    @staticmethod
    def for_client(choice: dict, req) -> dict:
        out = {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}
        if not req.logprobs:
            out["logprobs"] = None
        return out


TEXT, CHAT = _Text(), _Chat()
