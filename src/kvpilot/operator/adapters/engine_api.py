"""One engine pod's runtime LoRA API, as vLLM defines it (the engine mounts the two POST
routes only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``, which the operator sets):

* ``GET /v1/models``: the base model's card, and one card per adapter with ``parent``
  set (its base model) and ``root`` the path or URI it was loaded from;
* ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: 200 (plain text) when
  loaded; 400 ``... has already been loaded`` when the name is taken (a load that raced
  ours: done), any other 400 is the engine's refusal (a folder that is not an adapter for
  this model, a rank above ``--max-lora-rank``, a download that failed);
* ``POST /v1/unload_lora_adapter {"lora_name"}``: 200; 404 when the name is not loaded
  (done as well).

``lora_path`` is the spec's URI: the engine fetches s3://, oci://, hf:// and file://
itself. Loading may download and read a large adapter, so it gets a longer timeout than
the other calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

from kvpilot.operator import constants as c

CONNECT_TIMEOUT_SECONDS = 2.0
# GET /v1/models and unloads: quick answers from a serving engine.
CALL_TIMEOUT_SECONDS = 5.0
# A load downloads the adapter (possibly hundreds of MB) and checks it against the model.
LOAD_TIMEOUT_SECONDS = 300.0
ALREADY_LOADED = "has already been loaded"
# Engine error texts are cut to this many characters in status and Events.
MAX_ERROR_CHARS = 300


class AdapterApiError(Exception):
    """A call the engine refused or that got no answer; ``str()`` says which call, the
    HTTP status (if any) and the engine's own message."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter card of ``GET /v1/models``: its name and where it was loaded from."""

    name: str
    root: str


def engine_message(response: httpx.Response) -> str:
    """The engine's error text: ``error.message`` of a JSON error body (OpenAI's and
    vLLM's shape), ``detail`` (FastAPI's), else the body; cut to MAX_ERROR_CHARS."""
    text = response.text
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
        elif isinstance(body.get("message"), str):
            text = body["message"]
        elif isinstance(body.get("detail"), str):
            text = body["detail"]
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def _unauthorized_hint(response: httpx.Response) -> str:
    return ("; the engines require an API key: the operator sends one only from a plain"
            " KVPILOT_API_KEY value in env or --api-key in engine.extraArgs, never from a"
            " Secret" if response.status_code == 401 else "")


class EngineAdapterApi:
    """Talks to engine pods (``base``: ``http://IP:8000``). Thread-safe (one httpx client).

    Args:
        api_key: sent as ``Authorization: Bearer`` when the engines require one.
        client: an httpx client (tests pass one with a mock transport); by default one is
            made and owned.
    """

    def __init__(self, api_key: str | None = None, client: httpx.Client | None = None) -> None:
        self._owns = client is None
        self._client = client or httpx.Client(
            timeout=httpx.Timeout(CALL_TIMEOUT_SECONDS, connect=CONNECT_TIMEOUT_SECONDS),
            follow_redirects=False)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def close(self) -> None:
        if self._owns:
            self._client.close()

    def _post(self, url: str, body: dict[str, str], timeout: float) -> httpx.Response:
        try:
            return self._client.post(url, json=body, headers=self._headers,
                                     timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_SECONDS))
        except httpx.HTTPError as exc:
            raise AdapterApiError(f"POST {url}: {type(exc).__name__}: {exc}") from exc

    def loaded(self, base: str) -> list[LoadedAdapter]:
        """The adapters the pod serves (cards with ``parent``). Raises AdapterApiError."""
        url = base + c.MODELS_LIST_PATH
        try:
            response = self._client.get(url, headers=self._headers)
        except httpx.HTTPError as exc:
            raise AdapterApiError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise AdapterApiError(f"GET {c.MODELS_LIST_PATH}: {response.status_code}"
                                  f" {engine_message(response)}{_unauthorized_hint(response)}",
                                  response.status_code)
        try:
            cards = response.json()["data"]
            return [LoadedAdapter(str(card["id"]), str(card.get("root") or ""))
                    for card in cards if card.get("parent")]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise AdapterApiError(f"GET {c.MODELS_LIST_PATH}: not a model list: {exc!r}") from exc

    def load(self, base: str, name: str, uri: str) -> None:
        """Load ``uri`` as ``name`` (done too when the name was loaded meanwhile). Raises
        AdapterApiError with the engine's message."""
        response = self._post(base + c.LOAD_ADAPTER_PATH, {"lora_name": name, "lora_path": uri},
                              LOAD_TIMEOUT_SECONDS)
        if response.status_code == 200:
            return
        message = engine_message(response)
        if response.status_code == 400 and ALREADY_LOADED in message:
            return
        raise AdapterApiError(f"load {response.status_code}: {message}"
                              f"{_unauthorized_hint(response)}", response.status_code)

    def unload(self, base: str, name: str) -> None:
        """Unload ``name`` (a 404, not loaded, is done). Raises AdapterApiError."""
        response = self._post(base + c.UNLOAD_ADAPTER_PATH, {"lora_name": name},
                              CALL_TIMEOUT_SECONDS)
        if response.status_code in (200, 404):
            return
        raise AdapterApiError(f"unload {response.status_code}: {engine_message(response)}"
                              f"{_unauthorized_hint(response)}", response.status_code)
