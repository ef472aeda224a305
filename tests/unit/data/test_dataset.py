"""Prompt-set loading: JSONL, Parquet and built-in tasks; chat templates; errors that point at
the file and record."""

import json
import pathlib
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from rlkube_runtime.data import (
    DatasetError,
    load_prompt_dataset,
    load_prompt_dataset_from_spec,
    register_builtin_dataset,
)
from rlkube_runtime.spec.data import DataSpec
from rlkube_runtime.spec.eval import EvalDatasetSpec
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

# A real transformers tokenizer whose template renders tools and every message role, so the
# templated text shows what reached the template.
TOOL_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if 'tool_calls' in m %}(calls){% endif %}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>",
    )
    tok.chat_template = TOOL_TEMPLATE
    return tok


def write_jsonl(path: pathlib.Path, lines: list) -> pathlib.Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


CALC_TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def test_jsonl_records_become_pending_samples_in_file_order(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "1+1?", "label": "2", "metadata": {"id": 1}},
            "",  # blank lines are skipped
            {"prompt": "2+2?", "label": 4},
        ],
    )
    samples = load_prompt_dataset(path)
    assert [(s.prompt, s.raw_prompt, s.label, s.metadata) for s in samples] == [
        ("1+1?", "1+1?", "2", {"id": 1}),
        ("2+2?", "2+2?", 4, {}),
    ]
    assert all(s.status is s.Status.PENDING and s.index is None for s in samples)


def test_custom_keys_are_read_from_the_configured_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "hi", "a": "yo", "meta": {"x": 1}}])
    [sample] = load_prompt_dataset(path, input_key="q", label_key="a", metadata_key="meta")
    assert (sample.prompt, sample.label, sample.metadata) == ("hi", "yo", {"x": 1})


def test_label_key_none_loads_a_prompt_set_without_labels(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "judge me"}])
    assert load_prompt_dataset(path, label_key=None)[0].label is None


def test_chat_template_wraps_a_text_prompt_as_a_user_message_and_keeps_the_raw_prompt(
    tmp_path, tokenizer
):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1?", "label": "2"}])
    [sample] = load_prompt_dataset(path, tokenizer=tokenizer, apply_chat_template=True)
    assert sample.prompt == "<user>1+1?</user><assistant>"
    assert sample.raw_prompt == "1+1?"


def test_chat_template_keeps_tool_messages_and_passes_tools(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc"}}]},
        {"role": "tool", "content": "4"},
    ]
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": messages, "label": "4", "tools": [CALC_TOOL]}]
    )
    [sample] = load_prompt_dataset(path, tokenizer=tokenizer, apply_chat_template=True)
    assert sample.prompt == (
        "[tools:calc;]<system>be brief</system><user>2+2?</user>"
        "<assistant>(calls)</assistant><tool>4</tool><assistant>"
    )
    assert sample.raw_prompt == messages
    assert sample.tools == [CALC_TOOL]


def test_tools_and_metadata_given_as_json_strings_are_decoded(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "x", "label": "y", "tools": json.dumps([CALC_TOOL]), "metadata": '{"k": 1}'}],
    )
    [sample] = load_prompt_dataset(path)
    assert sample.tools == [CALC_TOOL] and sample.metadata == {"k": 1}


def test_parquet_rows_load_with_message_lists_and_struct_nones_dropped(tmp_path, tokenizer):
    table = pa.Table.from_pylist(
        [
            {"prompt": [{"role": "user", "content": "a"}], "label": "1", "metadata": {"id": 1}},
            {
                "prompt": [
                    {"role": "user", "content": "b"},
                    {"role": "tool", "content": "out", "name": "calc"},
                ],
                "label": "2",
                "metadata": {"id": 2},
            },
        ]
    )
    pq.write_table(table, tmp_path / "p.parquet")
    samples = load_prompt_dataset(
        tmp_path / "p.parquet", tokenizer=tokenizer, apply_chat_template=True
    )
    # Parquet adds "name": None to the first row's message; it must not reach the template.
    assert samples[0].raw_prompt == [{"role": "user", "content": "a"}]
    assert samples[1].raw_prompt[1] == {"role": "tool", "content": "out", "name": "calc"}
    assert [s.prompt for s in samples] == [
        "<user>a</user><assistant>",
        "<user>b</user><tool>out</tool><assistant>",
    ]
    assert [s.metadata for s in samples] == [{"id": 1}, {"id": 2}]


def test_from_spec_reads_the_data_spec_by_attribute(tmp_path, tokenizer):
    spec = DataSpec.model_validate({
        "promptData": str(write_jsonl(tmp_path / "p.jsonl", [{"question": "hi", "answer": "yo"}])),
        "inputKey": "question", "labelKey": "answer", "applyChatTemplate": True,
    })
    [sample] = load_prompt_dataset_from_spec(spec, tokenizer=tokenizer)
    assert (sample.prompt, sample.label) == ("<user>hi</user><assistant>", "yo")


# Qwen3's switch, as its template reads it: an empty think block when thinking is off.
THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<assistant>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
)


@pytest.mark.parametrize(("kwargs", "expected"), [({}, "<user>hi</user><assistant>"),
                                                 ({"enable_thinking": False}, "<user>hi</user><assistant><think></think>")])
def test_chat_template_kwargs_reach_the_template_for_the_prompts_and_the_eval_sets(tmp_path, kwargs, expected):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), unk_token="<unk>")
    tok.chat_template = THINKING_TEMPLATE
    path = str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "label": "yo"}]))
    spec = DataSpec.model_validate({"promptData": path, "applyChatTemplate": True, "chatTemplateKwargs": kwargs})
    eval_spec = EvalDatasetSpec.model_validate({"name": "held-out", "path": path}).data_spec(spec)
    assert [s.prompt for s in load_prompt_dataset_from_spec(spec, tokenizer=tok)] == [expected]
    assert [s.prompt for s in load_prompt_dataset_from_spec(eval_spec, tokenizer=tok)] == [expected]


def test_chat_template_kwargs_without_the_template_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="chatTemplateKwargs: chatTemplateKwargs go to the tokenizer's chat template"):
        DataSpec.model_validate({"promptData": "builtin:digit-successor", "chatTemplateKwargs": {"enable_thinking": False}})


# --- built-in tasks --------------------------------------------------------------------------


def test_builtin_prefix_loads_a_registered_task_through_the_same_checks():
    register_builtin_dataset(
        "test-count", lambda: [{"prompt": f"count {i}", "label": str(i)} for i in range(3)]
    )
    samples = load_prompt_dataset("builtin:test-count")
    assert [(s.prompt, s.label) for s in samples] == [
        ("count 0", "0"),
        ("count 1", "1"),
        ("count 2", "2"),
    ]


def test_the_projects_builtin_tasks_load_without_importing_their_module_first(tmp_path):
    # A fresh interpreter: nothing but the loader is imported.
    code = "from rlkube_runtime.data import load_prompt_dataset as l; s = l('builtin:digit-successor'); print(len(s), s[0].prompt, s[0].label)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["10", "0>", "1"]


def test_unknown_builtin_name_lists_the_known_ones():
    register_builtin_dataset("test-known", lambda: [{"prompt": "p", "label": "l"}])
    with pytest.raises(
        DatasetError,
        match=r"unknown built-in prompt set builtin:nope; known: \[.*'builtin:digit-successor'.*'builtin:test-known'",
    ):
        load_prompt_dataset("builtin:nope")


def test_registering_a_different_factory_under_a_taken_name_fails():
    def factory():
        return [{"prompt": "p", "label": "l"}]

    register_builtin_dataset("test-taken", factory)
    register_builtin_dataset("test-taken", factory)  # same factory again: a module reload
    with pytest.raises(ValueError, match="already registered"):
        register_builtin_dataset("test-taken", list)


def test_a_bad_builtin_record_is_named_by_task_and_record_number():
    register_builtin_dataset("test-bad", lambda: [{"prompt": "ok", "label": "1"}, {"label": "2"}])
    with pytest.raises(DatasetError, match=r"builtin:test-bad record 1: missing key 'prompt'"):
        load_prompt_dataset("builtin:test-bad")


# --- errors ----------------------------------------------------------------------------------


def test_missing_file_error_names_the_path(tmp_path):
    with pytest.raises(DatasetError, match=r"prompt data file .*nothere\.jsonl does not exist"):
        load_prompt_dataset(tmp_path / "nothere.jsonl")


@pytest.mark.parametrize("layout", ["array", "lines"])
def test_json_files_hold_an_array_of_records_or_json_lines(tmp_path, layout):
    records = [{"prompt": "1+1?", "label": "2"}, {"prompt": "2+2?", "label": "4"}]
    path = tmp_path / "p.json"
    if layout == "array":
        path.write_text(json.dumps(records, indent=2))
    else:
        write_jsonl(path, records)
    assert [(s.prompt, s.label) for s in load_prompt_dataset(path)] == [("1+1?", "2"), ("2+2?", "4")]


def test_a_json_array_of_non_objects_names_the_item(tmp_path):
    (tmp_path / "p.json").write_text('[{"prompt": "a", "label": "x"}, "b"]')
    with pytest.raises(DatasetError, match=r"p.json item 1: expected a JSON object, got str"):
        load_prompt_dataset(tmp_path / "p.json")


def test_unsupported_suffix_is_an_error_listing_the_formats(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,label\n")
    with pytest.raises(DatasetError, match=r"unsupported format '\.csv'; use \.jsonl, \.json or \.parquet"):
        load_prompt_dataset(tmp_path / "p.csv")


@pytest.mark.parametrize("name", ["p.jsonl", "p.json", "p.parquet", "p.JSONL", "p.Json", "p.csv", "p.json.gz", "p"])
def test_the_spec_accepts_a_prompt_file_exactly_where_the_loader_reads_it(tmp_path, name):
    """One list of formats: a path `rlkube validate` accepts loads, one it refuses does not."""
    records = [{"prompt": "1+1?", "label": "2"}]
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        write_jsonl(path, records)
    try:
        DataSpec.model_validate({"promptData": str(path)})
        spec_accepts = True
    except ValidationError as err:
        assert "must be a .jsonl, .json or .parquet file path" in str(err)
        spec_accepts = False
    try:
        loader_reads = [s.prompt for s in load_prompt_dataset(path)] == ["1+1?"]
    except DatasetError as err:
        assert "unsupported format" in str(err)
        loader_reads = False
    assert spec_accepts == loader_reads == (name in ("p.jsonl", "p.json", "p.parquet"))


def test_empty_prompt_set_is_an_error(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match=r"p\.jsonl: the prompt set is empty"):
        load_prompt_dataset(tmp_path / "p.jsonl")


def test_malformed_json_names_the_line(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "a", "label": "1"}, '{"prompt": "b", "label": ']
    )
    with pytest.raises(DatasetError, match=r"p\.jsonl line 2: malformed JSON"):
        load_prompt_dataset(path)


def test_a_line_that_is_not_an_object_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [["a", "1"]])
    with pytest.raises(DatasetError, match=r"line 1: expected a JSON object, got list"):
        load_prompt_dataset(path)


def test_missing_key_names_the_line_the_key_and_the_setting(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b"}, {"prompt": "c"}]
    )
    with pytest.raises(
        DatasetError,
        match=r"line 2: missing key 'label' \(keys present: \['prompt'\]\); set data\.labelKey",
    ):
        load_prompt_dataset(path)


@pytest.mark.parametrize(
    "prompt, shown",
    [
        (5, "int 5"),
        ([], "list \\[\\]"),
        (["hi"], "list \\['hi'\\]"),
        ([{"content": "no role"}], "list"),
    ],
)
def test_prompt_of_the_wrong_type_is_rejected_with_its_value(tmp_path, prompt, shown):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "label": "1"}])
    with pytest.raises(
        DatasetError,
        match=rf"line 1: 'prompt' must be a string or a non-empty list of messages.*got {shown}",
    ):
        load_prompt_dataset(path)


def test_metadata_that_is_not_an_object_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1", "metadata": [1, 2]}])
    with pytest.raises(
        DatasetError, match=r"line 1: 'metadata' must be a JSON dict \(object\), got list"
    ):
        load_prompt_dataset(path)


def test_tools_that_are_not_a_list_of_objects_are_rejected(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1", "tools": ["calc"]}])
    with pytest.raises(
        DatasetError, match=r"line 1: 'tools' must be a list of tool schema objects"
    ):
        load_prompt_dataset(path)


def test_parquet_missing_column_lists_the_columns(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"question": "a", "label": "1"}]), tmp_path / "p.parquet")
    with pytest.raises(
        DatasetError,
        match=r"p\.parquet: missing column\(s\) \['prompt'\]; columns are \['question', 'label'\]",
    ):
        load_prompt_dataset(tmp_path / "p.parquet")


def test_a_parquet_value_json_cannot_hold_is_rejected_at_load_time(tmp_path):
    import datetime

    rows = [{"prompt": "a", "label": "1", "metadata": {"when": datetime.datetime(2024, 1, 1)}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    with pytest.raises(
        DatasetError,
        match=r"p\.parquet row index 0: 'metadata' holds a value JSON cannot represent",
    ):
        load_prompt_dataset(tmp_path / "p.parquet")


def test_unreadable_parquet_names_the_file(tmp_path):
    (tmp_path / "p.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"p\.parquet: cannot read as Parquet"):
        load_prompt_dataset(tmp_path / "p.parquet")


def test_chat_template_without_a_tokenizer_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1"}])
    with pytest.raises(DatasetError, match="apply_chat_template is on but no tokenizer"):
        load_prompt_dataset(path, apply_chat_template=True)


def test_a_failing_chat_template_names_the_line(tmp_path):
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>",
    )
    tok.chat_template = (
        "{{ raise_exception('no tool role here') if messages[-1]['role'] == 'tool' }}x"
    )
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "ok", "label": "1"},
            {"prompt": [{"role": "tool", "content": "4"}], "label": "1"},
        ],
    )
    with pytest.raises(
        DatasetError, match=r"line 2: the tokenizer's chat template failed .*no tool role here"
    ):
        load_prompt_dataset(path, tokenizer=tok, apply_chat_template=True)
