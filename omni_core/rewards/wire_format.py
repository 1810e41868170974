"""The reward-server wire formats: OmniFlow's JSON (the default) and flow_grpo's pickle, both directions.

`WIRE_FORMATS` holds one `WireFormat` per name a reward entry's `format` takes: its content type, how a client
encodes a batch and parses the answer, and how it reads the reason out of an error answer. Everything that
depends on the format goes through the table, never a test of the name.

JSON (`POST <server_url>`, `Content-Type: application/json`)::

    request   {"images": ["<base64 PNG>", ...], "prompts": ["...", ...],
               "metadata": [{"data_source": ..., "ground_truth": ..., "extra_info": {...}}, ...]}
    response  {"scores": [float | null, ...], "extras": [{...}, ...], "errors": [null | "reason", ...]}

One entry per image in every list (`extras` and `errors` may be left out). A null score fails that image with its
`errors` entry as the reason; an `errors` entry also fails an image that has a score. Any other HTTP status than
200 fails the whole batch: the body `{"error": "reason"}` (or its text) is the reason.

flow_grpo's pickle format (as verl-omni's `http_scorer_client` speaks it)::

    request   pickle.dumps({"images": [<JPEG bytes>, ...], "prompts": [...], "metadata": {}})
    response  pickle.dumps({"scores": [float, ...]}) or pickle.dumps({"error": "reason"})

A pickle can run code while it loads, so a server's answer is read with `restricted_loads`: an unpickler that
refuses every global, which plain dicts, lists, strings, bytes, numbers and None never need (a numpy scalar in the
answer is refused with the reason: send `float(x)`).
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from omni_core.rewards.builtin import to_hwc_uint8
from omni_core.rewards.terms import SampleFailure

__all__ = [
    "JSON_FORMAT",
    "PICKLE_FORMAT",
    "WIRE_FORMATS",
    "WireFormat",
    "WireFormatError",
    "decode_png",
    "encode_png",
    "json_request",
    "json_response",
    "parse_json_request",
    "parse_json_response",
    "parse_pickle_response",
    "pickle_request",
    "restricted_loads",
]


class WireFormatError(ValueError):
    """A request or response that does not follow the wire format; the message says what is wrong."""


# ------------------------------------------------------------------------------------------ images
def encode_png(image: Any) -> bytes:
    """One image (uint8 CHW tensor, HWC array or PIL image) as PNG bytes (lossless)."""
    buffer = io.BytesIO()
    Image.fromarray(to_hwc_uint8(image)).save(buffer, format="PNG")
    return buffer.getvalue()


def encode_jpeg(image: Any) -> bytes:
    """One image as JPEG bytes at PIL's default quality, as flow_grpo's and verl-omni's clients send it."""
    buffer = io.BytesIO()
    Image.fromarray(to_hwc_uint8(image)).convert("RGB").save(buffer, format="JPEG")
    return buffer.getvalue()


def decode_png(data: bytes) -> torch.Tensor:
    """PNG (or any PIL-readable) bytes as a uint8 CHW RGB tensor, the layout a rollout hands rewards."""
    with Image.open(io.BytesIO(data)) as img:
        array = np.asarray(img.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


# ------------------------------------------------------------------------------------------ JSON
def jsonable(value: Any) -> Any:
    """`value` with numpy / torch values made plain (lists, floats); anything else unknown becomes its str."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def json_request(images: Sequence[Any], prompts: Sequence[Any], metadata: Sequence[dict[str, Any]]) -> bytes:
    body = {
        "images": [base64.b64encode(encode_png(img)).decode("ascii") for img in images],
        "prompts": jsonable(list(prompts)),
        "metadata": jsonable(list(metadata)),
    }
    return json.dumps(body).encode()


def _list_of(body: dict[str, Any], key: str, n: int, required: bool) -> list[Any] | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise WireFormatError(f"'{key}' must be a list with one entry per image ({n}), got {got}")
    return value


def parse_json_request(data: bytes) -> tuple[list[torch.Tensor], list[Any], list[dict[str, Any]]]:
    """A JSON request as (uint8 CHW images, prompts, metadata dicts); `WireFormatError` says what is wrong."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise WireFormatError("the body must be a JSON object with images, prompts and metadata")
    encoded = body.get("images")
    if not isinstance(encoded, list) or not encoded:
        raise WireFormatError("'images' must be a non-empty list of base64-encoded PNG images")
    n = len(encoded)
    prompts = _list_of(body, "prompts", n, required=False) or [None] * n
    metadata = _list_of(body, "metadata", n, required=False) or [{}] * n
    images = []
    for k, item in enumerate(encoded):
        try:
            images.append(decode_png(base64.b64decode(item, validate=True)))
        except Exception as exc:
            raise WireFormatError(f"images[{k}] is not a base64-encoded image: {type(exc).__name__}: {exc}") from exc
    if not all(isinstance(m, dict) for m in metadata):
        raise WireFormatError("each 'metadata' entry must be an object {data_source, ground_truth, extra_info}")
    return images, prompts, metadata


def json_response(scores: Sequence[float], failed: Sequence[bool], reasons: Sequence[str | None], extras: Sequence[dict]) -> dict:
    """A scoring result as the JSON response body: failed samples get a null score and their reason."""
    return {
        "scores": [None if f else float(s) for s, f in zip(scores, failed, strict=True)],
        "extras": [jsonable(e) for e in extras],
        "errors": [r if f else None for r, f in zip(reasons, failed, strict=True)],
    }


def parse_json_response(data: bytes, n: int) -> list[Any]:
    """A JSON response as one outcome per image: a number, `{"score", <extras>}`, or a `SampleFailure`."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"the server's answer is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise WireFormatError(f"the server's answer must be a JSON object with 'scores', got {type(body).__name__}")
    scores = _list_of(body, "scores", n, required=True)
    errors = _list_of(body, "errors", n, required=False) or [None] * n
    extras = _list_of(body, "extras", n, required=False) or [None] * n
    outcomes: list[Any] = []
    for score, error, extra in zip(scores, errors, extras, strict=True):
        if error is not None or score is None:
            outcomes.append(SampleFailure(f"server: {error}" if error is not None else "server: no score and no reason"))
        elif isinstance(extra, dict) and extra:
            outcomes.append({**extra, "score": score})
        else:
            outcomes.append(score)
    return outcomes


# ------------------------------------------------------------------------------------------ pickle
class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the answer needs the global {module}.{name}; OmniFlow reads a server's pickle with no globals at all "
            "(plain dict / list / str / bytes / int / float / None): send Python floats, e.g. float(x)"
        )


def restricted_loads(data: bytes) -> Any:
    """`pickle.loads` that refuses every global, so a server's answer cannot run code while it loads."""
    return _NoGlobalsUnpickler(io.BytesIO(data)).load()


def pickle_request(images: Sequence[Any], prompts: Sequence[Any]) -> bytes:
    """flow_grpo's request: JPEG bytes, prompts, and the reserved (empty) metadata dict."""
    return pickle.dumps({"images": [encode_jpeg(img) for img in images], "prompts": list(prompts), "metadata": {}})


def parse_pickle_response(data: bytes, n: int) -> list[Any]:
    """flow_grpo's response as one score per image; `{"error": ...}` or a malformed answer raises `WireFormatError`."""
    try:
        body = restricted_loads(data)
    except Exception as exc:
        raise WireFormatError(f"the server's answer is not a readable pickle: {type(exc).__name__}: {exc}") from exc
    if not isinstance(body, dict):
        raise WireFormatError(f"the server's answer must be a dict with 'scores', got {type(body).__name__}")
    if "error" in body:
        raise WireFormatError(f"the server reported: {body['error']}")
    return list(_list_of(body, "scores", n, required=True))


def _pickle_request_of(images: Sequence[Any], prompts: Sequence[Any], metadata: Sequence[dict[str, Any]]) -> bytes:
    # flow_grpo's request has no per-sample metadata and a text prompt for every image
    return pickle_request(images, ["" if p is None else p for p in prompts])


# ------------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class WireFormat:
    """One wire format, as a client speaks it.

    `encode(images, prompts, metadata)` is the request body; `parse(body, n)` one outcome per image of a 200
    answer (a number, `{"score", <extras>}` or a `SampleFailure`); `load_error(body)` decodes an error answer
    (a dict whose `"error"` is the reason, read by `error_detail`).
    """

    name: str
    content_type: str
    encode: Callable[[Sequence[Any], Sequence[Any], Sequence[dict[str, Any]]], bytes]
    parse: Callable[[bytes, int], list[Any]]
    load_error: Callable[[bytes], Any]

    def error_detail(self, data: bytes) -> str:
        """The reason in an error answer (`{"error": ...}` in this format, else its text), at most 500 characters."""
        try:
            body = self.load_error(data)
            if isinstance(body, dict) and "error" in body:
                return str(body["error"])[:500]
        except Exception:
            pass
        return data.decode("utf-8", errors="replace").strip()[:500] or "(empty body)"


JSON_FORMAT = WireFormat("json", "application/json", json_request, parse_json_response, json.loads)
PICKLE_FORMAT = WireFormat(
    "flow_grpo_pickle", "application/octet-stream", _pickle_request_of, parse_pickle_response, restricted_loads
)
# Keyed by the names a reward entry's `format` takes (the config schema's Literal lists the same; a test checks).
WIRE_FORMATS: dict[str, WireFormat] = {f.name: f for f in (JSON_FORMAT, PICKLE_FORMAT)}
