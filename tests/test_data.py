"""Prompt files (parquet / JSONL / JSON / txt), make_dataset, and the resumable prompt loader."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omni_core.data.dataloader import PromptDataLoader
from omni_core.data.make_dataset import make_dataset
from omni_core.data.prompts import PromptFileError, PromptRecord, load_prompts
from omni_core.data_files import DataFileError, resolve_data_path


def _verl_row(text, i, **extra):
    return {
        "data_source": "ocr",
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        "ability": "image_generation",
        "reward_model": {"style": "rule", "ground_truth": f"gt{i}"},
        "extra_info": {"split": "train", "index": i},
        **extra,
    }


# ------------------------------------------------------------------------------------ loading
def test_parquet_chat_messages(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([_verl_row("a cat", 0, negative_prompt="blurry"), _verl_row("a dog", 1, negative_prompt=None)]), path
    )
    recs = load_prompts(str(path))
    assert [r.prompt for r in recs] == ["a cat", "a dog"]  # the user message, not the system one
    assert recs[0].negative_prompt == "blurry" and recs[1].negative_prompt is None
    assert recs[1] == PromptRecord(
        prompt="a dog",
        negative_prompt=None,
        data_source="ocr",
        ground_truth="gt1",
        extra_info={"split": "train", "index": 1},
        index=1,
    )


def test_parquet_plain_string_column_and_custom_key(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"caption": "red ball"}, {"caption": "blue box"}]), path)
    recs = load_prompts(path, prompt_key="caption", default_data_source="aesthetic")
    assert [(r.prompt, r.data_source, r.ground_truth, r.extra_info) for r in recs] == [
        ("red ball", "aesthetic", None, {}),
        ("blue box", "aesthetic", None, {}),
    ]


def test_jsonl_json_and_txt(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps(_verl_row("one", 0)) + "\n\n" + json.dumps({"prompt": "two", "negative_prompt": "ugly"}) + "\n")
    js = tmp_path / "b.json"
    js.write_text(json.dumps([{"prompt": [{"role": "user", "content": [{"type": "text", "text": "three"}]}]}]))
    txt = tmp_path / "c.txt"
    txt.write_text("# header comment\nfour\n\n   five  \n#six\n")
    recs = load_prompts([str(jsonl), str(js), str(txt)])
    assert [r.prompt for r in recs] == ["one", "two", "three", "four", "five"]
    assert [r.index for r in recs] == [0, 1, 2, 3, 4]  # global position over all files
    assert recs[0].ground_truth == "gt0" and recs[1].negative_prompt == "ugly"
    assert recs[3].data_source == "jpeg_compressibility"
    assert [r.prompt for r in load_prompts([str(jsonl), str(txt)], max_samples=3)] == ["one", "two", "four"]


def test_shipped_pkg_prompts_load():
    recs = load_prompts("pkg://omni_core/assets/prompts/train.txt")
    assert len(recs) >= 2 and all(r.prompt and not r.prompt.startswith("#") for r in recs)


def test_make_dataset_round_trip(tmp_path):
    src = tmp_path / "prompts.txt"
    src.write_text("# comment\na red circle\n\na blue square\n")
    out = make_dataset(src, tmp_path / "out" / "train.parquet", split="train")
    assert out.is_file() and not list(out.parent.glob(".*tmp*"))
    row = pq.read_table(out).to_pylist()[1]
    assert row == {
        "data_source": "jpeg_compressibility",
        "prompt": [{"role": "user", "content": "a blue square"}],
        "ability": "image_generation",
        "reward_model": {"style": "rule", "ground_truth": ""},
        "extra_info": {"split": "train", "index": 1},
    }
    recs = load_prompts(str(out))
    assert [r.prompt for r in recs] == [r.prompt for r in load_prompts(str(src))] == ["a red circle", "a blue square"]
    assert recs[0].extra_info == {"split": "train", "index": 0}


# ------------------------------------------------------------------------------------- errors
def test_bad_files_name_file_and_row(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(PromptFileError, match=r"empty\.txt: no prompts"):
        load_prompts(str(empty))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(PromptFileError, match=r"bad\.jsonl: line 2: invalid JSON"):
        load_prompts(str(bad))

    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), nocol)
    with pytest.raises(
        PromptFileError, match=r"nocol\.parquet: row 0: no 'prompt' column \(columns: text\); set data.prompt_key"
    ):
        load_prompts(str(nocol))

    nouser = tmp_path / "nouser.jsonl"
    nouser.write_text(
        json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": [{"role": "assistant", "content": "x"}]}) + "\n"
    )
    with pytest.raises(PromptFileError, match=r"nouser\.jsonl: line 2: 'prompt' is a chat without a user message"):
        load_prompts(str(nouser))

    with pytest.raises(DataFileError, match="prompt file not found"):
        load_prompts(str(tmp_path / "missing.parquet"))


# --------------------------------------------------------------------------------- dataloader
def _records(n):
    return [PromptRecord(prompt=f"p{i}", index=i) for i in range(n)]


def _ids(batch):
    return [r.index for r in batch]


def test_shuffle_is_seeded_and_differs_per_epoch():
    recs = _records(12)
    a = PromptDataLoader(recs, 3, shuffle=True, seed=7)
    b = PromptDataLoader(recs, 3, shuffle=True, seed=7)
    epoch0 = [i for batch in a for i in _ids(batch)]
    epoch1 = [i for batch in a for i in _ids(batch)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))  # each epoch is a permutation
    assert epoch0 != epoch1
    assert [i for batch in b for i in _ids(batch)] == epoch0  # same seed, same order
    other = [i for batch in PromptDataLoader(recs, 3, shuffle=True, seed=8) for i in _ids(batch)]
    assert other != epoch0
    plain = PromptDataLoader(recs, 3, shuffle=False, seed=7)
    assert [_ids(x) for x in plain] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_resume_mid_epoch_equals_uninterrupted_over_epochs():
    recs = _records(10)  # batch 3, drop_last: 3 steps per epoch, one prompt left out each epoch
    reference = PromptDataLoader(recs, 3, shuffle=True, seed=42)
    expected = [_ids(reference.next_batch()) for _ in range(12)]  # 4 epochs
    assert reference.steps_per_epoch == 3 and reference.epoch == 4

    for stop in (1, 2, 3, 4, 7):  # mid-epoch and exactly at epoch boundaries
        first = PromptDataLoader(recs, 3, shuffle=True, seed=42)
        got = [_ids(first.next_batch()) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # goes through a JSON checkpoint file
        resumed = PromptDataLoader(recs, 3, shuffle=True, seed=42)
        resumed.load_state_dict(state)
        got += [_ids(resumed.next_batch()) for _ in range(12 - stop)]
        assert got == expected, stop


def test_iteration_runs_rest_of_epoch_then_rolls_over():
    loader = PromptDataLoader(_records(8), 2, shuffle=True, seed=1)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["position"] == 1
    assert len(list(it)) == 3
    assert (loader.epoch, loader.position) == (1, 0)
    assert len(list(loader)) == 4 and loader.epoch == 2


def test_load_state_dict_refuses_other_data():
    state = PromptDataLoader(_records(8), 2, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_records: checkpoint 8 vs now 9"):
        PromptDataLoader(_records(9), 2, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptDataLoader(_records(8), 2, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="train_batch_size=5 is larger than the 4 prompts"):
        PromptDataLoader(_records(4), 5, shuffle=True, seed=1)
    assert PromptDataLoader(_records(5), 2, shuffle=False, seed=None, drop_last=False).steps_per_epoch == 3


def test_geneval_style_metadata_rows_keep_their_fields_for_the_rewards():
    """flow_grpo's GenEval layout: `{"tag", "include", "exclude", "prompt"}` per line, no verl fields. The shipped
    file loads through the JSONL reader with each row's metadata as `extra_info` (what a reward function gets)."""
    recs = load_prompts("pkg://omni_core/assets/prompts/geneval_style.jsonl")
    rows = [
        json.loads(line)
        for line in resolve_data_path("pkg://omni_core/assets/prompts/geneval_style.jsonl").read_text().splitlines()
    ]
    assert len(recs) == len(rows) == 12
    assert {r.extra_info["tag"] for r in recs} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    for rec, row in zip(recs, rows, strict=True):
        assert rec.prompt == row["prompt"]
        assert rec.extra_info == {k: v for k, v in row.items() if k != "prompt"}
        assert rec.data_source == "jpeg_compressibility" and rec.ground_truth is None  # no verl fields: the defaults
    counting = next(r for r in recs if r.prompt == "a photo of three apples")
    assert counting.extra_info["include"] == [{"class": "apple", "count": 3}]
