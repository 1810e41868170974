"""The built-in OCR reward `ocr`: how much of the target text a real OCR model reads in the image.

The model is PaddleOCR's PP-OCRv4 (text detector + recogniser, the family flow_grpo's OCR reward runs), as ONNX files
shipped inside the `rapidocr-onnxruntime` wheel: nothing is downloaded at run time. One reader per process, loaded on
first use and shared by every term and thread (a rollout worker or a reward server holds one copy).

The score is flow_grpo's (`flow_grpo/ocr.py`), written out here:

    target     the text the image should show: the sample's ground truth (verl-omni's OCR data,
               `reward_model.ground_truth`; when it holds a quoted span, as verl-omni's HTTP-service layout writes the
               whole prompt, the first quoted span), else the first "quoted" span of the prompt (flow_grpo's data)
    read       every text box the model recognised with a positive confidence, joined in reading order
    both lower-cased with spaces removed;  d = 0 if target is a substring of read, else min(Levenshtein(read, target),
    len(target));  score = 1 - d / len(target)                                                    in [0, 1]

A sample with no target text fails (its reason says so) rather than scoring 0: a data problem, not a bad image.
`ground_truth` of a data row and verl-omni's `data_source="flow_grpo/ocr"` select this reward without any config
(`omni_core.rewards.names.DATA_SOURCE_REWARDS`).
"""

from __future__ import annotations

import re
import threading
from typing import Any

from omni_core.rewards.builtin import to_hwc_uint8
from omni_core.rewards.terms import BatchRewardTerm, RewardBatch, SampleFailure

__all__ = ["edit_distance", "load_reader", "ocr_score", "ocr_target", "ocr_term", "read_text", "term"]

_QUOTED = re.compile(r'"([^"]*)"')
_READER: Any = None
_LOCK = threading.Lock()


def ocr_target(prompt: str | None, ground_truth: Any = None) -> str | None:
    """The text the image should show (module docstring), or None when neither the ground truth nor the prompt has it."""
    if isinstance(ground_truth, str) and ground_truth.strip():
        quoted = _QUOTED.search(ground_truth)
        return quoted.group(1) if quoted and quoted.group(1).strip() else ground_truth
    quoted = _QUOTED.search(prompt or "")
    return quoted.group(1) if quoted and quoted.group(1).strip() else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning a into b."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(read: str, target: str) -> float:
    """flow_grpo's OCR score of the text read against the target (module docstring)."""
    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        raise ValueError("the target text is empty once spaces are removed")
    distance = 0 if target in read else min(edit_distance(read, target), len(target))
    return 1.0 - distance / len(target)


def load_reader() -> Any:
    """The process's PP-OCRv4 reader (`rapidocr_onnxruntime.RapidOCR`), loaded once."""
    global _READER
    with _LOCK:
        if _READER is None:
            from rapidocr_onnxruntime import RapidOCR

            _READER = RapidOCR()
        return _READER


def read_text(reader: Any, image: Any) -> str:
    """The text `reader` recognises in one image (uint8 HWC / CHW / PIL), its boxes joined in reading order."""
    pixels = to_hwc_uint8(image)
    if pixels.ndim == 2:
        pixels = pixels[..., None].repeat(3, axis=-1)
    boxes, _ = reader(pixels[..., :3])
    return "".join(text for _, text, confidence in boxes or [] if float(confidence) > 0)


def ocr_term(weight: float = 1.0, batch_size: int = 8, label: str = "ocr") -> BatchRewardTerm:
    """The batched term of the `ocr` reward: per sample its score, with the text read as an extra."""

    def score(batch: RewardBatch) -> list[Any]:
        reader = load_reader()
        out: list[Any] = []
        for image, prompt, truth in zip(batch.images, batch.prompts, batch.ground_truths, strict=True):
            target = ocr_target(prompt, truth)
            if target is None:
                out.append(SampleFailure('no target text: the row has no ground_truth and its prompt no "quoted" text'))
                continue
            read = read_text(reader, image)
            out.append({"score": ocr_score(read, target), "ocr_chars_read": float(len(read))})
        return out

    return BatchRewardTerm(label=label, fn=score, weight=weight, batch_size=batch_size, max_concurrency=1)


def term(spec: Any) -> BatchRewardTerm:
    """The term of a `reward.reward_functions` entry `{name: ocr, weight, batch_size}`."""
    return ocr_term(weight=spec.weight, batch_size=spec.batch_size)
