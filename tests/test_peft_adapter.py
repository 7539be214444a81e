"""A memory as a PEFT prompt-tuning adapter: `elm memories export ID --format peft DIR` writes what
`PeftModel.from_pretrained(base, DIR)` loads, with ELM's greedy output at the prefix position, and
`elm memories import DIR` takes it back (keys rebuilt by the configured builder); bad adapters are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _fakes import fake_model_info
from typer.testing import CliRunner

from elm_memory.cli.memories import memories_app
from elm_memory.config import ELMConfig
from elm_memory.errors import AdapterError
from elm_memory.memory import LatentMemory
from elm_memory.memory.peft import export_adapter, read_adapter
from elm_memory.models.loading import ModelInfo
from elm_memory.store.chroma import ChromaMemoryStore

K = 4
QUESTION = "Tom has 3 apples and buys 5 more. How many apples does he have?"
PROMPT = "Question: What is the capital of France?\nAnswer:"


def _config_file(tmp_path: Path, **extra: dict) -> Path:
    data = {
        "model": {"name_or_path": "packaged:smollm2-135m", "dtype": "float32", "device": "cpu"},
        "memory": {"num_tokens": K},
        "retrieval": {"key": "kv"},
        "store": {"path": str(tmp_path / "store")},
        **extra,
    }
    path = tmp_path / "elm.yaml"
    path.write_text(json.dumps(data), encoding="utf-8")  # JSON is YAML
    return path


def _memory(loaded, position: str = "prefix", seed: int = 0) -> LatentMemory:
    """Question-initialised soft prompt, nudged so that it is no token sequence (no training needed)."""
    ids = loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"][:K]
    weight = loaded.model.get_input_embeddings().weight.detach().float()
    g = torch.Generator().manual_seed(seed)
    sp = weight[torch.tensor(ids)] + 0.5 * weight.std() * torch.randn(K, weight.shape[1], generator=g)
    m = LatentMemory.create(
        sp, question=QUESTION, namespace="default", model=loaded.info, config={"soft_prompt_position": position}
    )
    m.keys = {"input": torch.randn(loaded.info.hidden_size, generator=g)}  # placeholder: import must rebuild keys
    return m


def _store(cfg_file: Path, info: ModelInfo) -> ChromaMemoryStore:
    return ChromaMemoryStore.from_config(ELMConfig.load(cfg_file).store, model=info)


def _invoke(*args: str):
    return CliRunner().invoke(memories_app, [str(a) for a in args])


def _one_line_error(res, *fragments: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output  # (transformers' load progress aside)
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.model
def test_export_loads_in_peft_with_elms_greedy_output(tmp_path: Path, tiny_loaded, tiny_backend) -> None:
    peft = pytest.importorskip("peft")
    from elm_memory.backends.base import PromptInput, SamplingParams
    from elm_memory.config import ModelConfig
    from elm_memory.models.loading import load_model

    cfg_file = _config_file(tmp_path)
    memory = _memory(tiny_loaded)
    _store(cfg_file, tiny_loaded.info).put(memory)
    out = tmp_path / "adapter"
    res = _invoke("export", memory.id, "--format", "peft", out, "--config", cfg_file)
    assert res.exit_code == 0, res.output
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["peft_type"] == "PROMPT_TUNING" and adapter_cfg["task_type"] == "CAUSAL_LM"
    assert (adapter_cfg["num_virtual_tokens"], adapter_cfg["token_dim"]) == (K, tiny_loaded.info.hidden_size)
    elm_meta = json.loads((out / "elm_memory.json").read_text())["memory"]
    assert elm_meta["model_fingerprint"] == tiny_loaded.info.fingerprint and elm_meta["id"] == memory.id

    # the real client, on a fresh copy of the base model (the session fixture stays unwrapped)
    base = load_model(ModelConfig(name_or_path="packaged:smollm2-135m", dtype="float32", device="cpu")).model
    model = peft.PeftModel.from_pretrained(base, str(out))
    assert type(model).__name__ == "PeftModelForCausalLM"
    loaded_prompt = model.prompt_encoder["default"].embedding.weight.detach()
    assert torch.equal(loaded_prompt, memory.soft_prompt)

    ids = tiny_loaded.tokenizer(PROMPT)["input_ids"]
    n = 24
    with torch.no_grad():
        seq = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )[0].tolist()
    peft_tokens = seq[len(ids) :] if seq[: len(ids)] == ids else seq
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    with_memory, plain = tiny_backend.generate(
        [PromptInput(tuple(ids), soft_prompt=memory.soft_prompt, soft_prompt_at=0), PromptInput(tuple(ids))], params
    )
    eos = set(tiny_loaded.tokenizer.all_special_ids)
    strip = lambda toks: [t for t in toks if t not in eos]  # noqa: E731  (HF may keep the eos token)
    assert strip(peft_tokens) == strip(with_memory[0].token_ids), (
        tiny_loaded.tokenizer.decode(peft_tokens),
        with_memory[0].text,
    )
    assert len(strip(peft_tokens)) > 3
    assert strip(plain[0].token_ids) != strip(peft_tokens)  # the memory changes the answer: the comparison has teeth


@pytest.mark.model
def test_import_round_trip_rebuilds_keys(tmp_path: Path, tiny_loaded) -> None:
    from elm_memory.memory.keys import KVKeyBuilder

    cfg_file = _config_file(tmp_path)
    memory = _memory(tiny_loaded, seed=1)
    store = _store(cfg_file, tiny_loaded.info)
    store.put(memory)
    out = tmp_path / "adapter"
    assert _invoke("export", out, "--id", memory.id, "--format", "peft", "--config", cfg_file).exit_code == 0
    assert _invoke("delete", memory.id, "--config", cfg_file).exit_code == 0 and store.count() == 0

    res = _invoke("import", out, "--config", cfg_file, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"imported": [memory.id]}
    back = store.load(store.record(memory.id))
    assert torch.equal(back.soft_prompt, memory.soft_prompt)
    assert (back.meta.question, back.meta.namespace, back.meta.model_fingerprint) == (
        QUESTION,
        "default",
        tiny_loaded.info.fingerprint,
    )
    assert set(back.keys) == {"kv"}  # the configured builder's key, not the placeholder the memory had
    q_ids = tiny_loaded.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    expected = KVKeyBuilder().memory_key(tiny_loaded, memory.soft_prompt, q_ids)
    torch.testing.assert_close(back.keys["kv"], expected, rtol=1e-4, atol=1e-5)
    assert tuple(store.record(memory.id).kinds) == ("kv",)


@pytest.mark.model
def test_bad_adapters_are_refused_and_nothing_is_stored(tmp_path: Path, tiny_loaded) -> None:
    cfg_file = _config_file(tmp_path)
    store = _store(cfg_file, tiny_loaded.info)
    memory = _memory(tiny_loaded, seed=2)
    user_turn = _memory(tiny_loaded, position="user_turn", seed=3)
    store.put_many([memory, user_turn])

    # a user_turn memory has no prompt-tuning form
    res = _invoke("export", user_turn.id, "--format", "peft", tmp_path / "ut", "--config", cfg_file)
    _one_line_error(res, "soft_prompt_position='user_turn'", "prefix")
    assert not (tmp_path / "ut").exists()
    with pytest.raises(AdapterError):
        export_adapter(memory, tmp_path / "x", position="user_turn", base_model="m")

    good = tmp_path / "good"
    assert _invoke("export", memory.id, "--format", "peft", good, "--config", cfg_file).exit_code == 0
    assert _invoke("delete", memory.id, "--config", cfg_file).exit_code == 0
    before = store.count()

    # another token count than the config's memory.num_tokens (refused before the model loads)
    res = _invoke("import", good, "--config", cfg_file, "--set", "memory.num_tokens=5")
    _one_line_error(res, "num_virtual_tokens is 4", "memory.num_tokens is 5")
    # a config that places memories at user_turn
    res = _invoke("import", good, "--config", cfg_file, "--set", "prompt.soft_prompt_position=user_turn")
    _one_line_error(res, "prompt.soft_prompt_position")

    # another base model: the embedding fingerprint differs
    other = tmp_path / "other"
    _copy(good, other)
    meta = json.loads((other / "elm_memory.json").read_text())
    meta["memory"]["model_fingerprint"] = "f" * 16
    (other / "elm_memory.json").write_text(json.dumps(meta))
    _one_line_error(_invoke("import", other, "--config", cfg_file), "model_fingerprint", "f" * 16)

    # another hidden size (a consistent adapter for a model with hidden size 8)
    info8 = fake_model_info(fingerprint=tiny_loaded.info.fingerprint)
    small = LatentMemory.create(torch.randn(K, 8), question=QUESTION, namespace="default", model=info8)
    export_adapter(small, tmp_path / "small", position="prefix", base_model="fake")
    _one_line_error(_invoke("import", tmp_path / "small", "--config", cfg_file), "token_dim is 8", "hidden size 576")

    # malformed folders
    lora = tmp_path / "lora"
    _copy(good, lora)
    cfg = json.loads((lora / "adapter_config.json").read_text())
    (lora / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "LORA"}))
    _one_line_error(_invoke("import", lora, "--config", cfg_file), "peft_type is 'LORA'")
    bare = tmp_path / "bare"
    _copy(good, bare)
    (bare / "elm_memory.json").unlink()
    _one_line_error(_invoke("import", bare, "--config", cfg_file), "no elm_memory.json")
    shape = tmp_path / "shape"
    _copy(good, shape)
    (shape / "adapter_config.json").write_text(json.dumps({**cfg, "num_virtual_tokens": 3}))
    with pytest.raises(AdapterError, match="num_virtual_tokens=3"):
        read_adapter(shape)
    # one bad folder among good ones: nothing stored
    _one_line_error(_invoke("import", good, other, "--config", cfg_file), "model_fingerprint")
    assert store.count() == before and memory.id not in {r.id for r in store.list()}


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
