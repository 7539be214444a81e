"""A LoRA memory written as a llama.cpp adapter file (elm_memory/memory/gguf_lora.py): names, shapes, values,
the header llama.cpp checks, and typed errors. No llama.cpp needed: the file is read back with the gguf package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from elm_memory.errors import MemoryFormatError
from elm_memory.memory.gguf_lora import (
    HF_LAYOUT,
    INTERLEAVED_QK,
    gguf_tensor_names,
    interleave_heads,
    read_gguf_lora,
    write_gguf_lora,
)
from elm_memory.memory.lora import LoraAdapter


def _adapter(modules: list[str], rank: int = 4) -> LoraAdapter:
    g = torch.Generator().manual_seed(0)
    return LoraAdapter(
        {m: (torch.randn(rank, 16, generator=g), torch.randn(24, rank, generator=g)) for m in modules}, 8
    )


def test_every_target_module_maps_to_its_gguf_weight():
    modules = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.down_proj",
    ]
    names = gguf_tensor_names(_adapter(modules), "qwen2", 2)
    assert names == {
        "model.layers.0.self_attn.q_proj": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.o_proj": "blk.0.attn_output.weight",
        "model.layers.1.mlp.gate_proj": "blk.1.ffn_gate.weight",
        "model.layers.1.mlp.down_proj": "blk.1.ffn_down.weight",
    }


def test_the_file_holds_a_and_b_in_peft_shapes_with_alpha_and_the_adapter_header(tmp_path):
    adapter = _adapter(["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"])
    path = write_gguf_lora(adapter, tmp_path / "lora.gguf", arch="qwen2", n_blocks=2)
    tensors = read_gguf_lora(path)
    assert sorted(tensors) == [
        "blk.0.attn_q.weight.lora_a",
        "blk.0.attn_q.weight.lora_b",
        "blk.1.attn_v.weight.lora_a",
        "blk.1.attn_v.weight.lora_b",
    ]
    a, b = adapter.weights["model.layers.1.self_attn.v_proj"]
    assert np.array_equal(tensors["blk.1.attn_v.weight.lora_a"], a.numpy())  # (r, in): A as PEFT holds it
    assert np.array_equal(tensors["blk.1.attn_v.weight.lora_b"], b.numpy())  # (out, r)
    reader = gguf.GGUFReader(str(path))
    alpha = reader.fields[gguf.Keys.Adapter.LORA_ALPHA]
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    assert float(alpha.parts[alpha.data[0]][0]) == 8.0 and bytes(arch.parts[arch.data[0]]).decode() == "qwen2"
    assert not list(tmp_path.glob("*.partial-*"))  # written atomically


def test_float16_halves_the_file(tmp_path):
    adapter = _adapter(["model.layers.0.self_attn.q_proj"], rank=16)
    full = write_gguf_lora(adapter, tmp_path / "a.gguf", arch="qwen2", n_blocks=1)
    half = write_gguf_lora(adapter, tmp_path / "b.gguf", arch="qwen2", n_blocks=1, dtype="float16")
    assert half.stat().st_size < 0.7 * full.stat().st_size
    a = adapter.weights["model.layers.0.self_attn.q_proj"][0].numpy()
    assert np.allclose(read_gguf_lora(half)["blk.0.attn_q.weight.lora_a"], a, atol=2e-3)


def test_unknown_names_and_files_are_typed_errors(tmp_path):
    with pytest.raises(MemoryFormatError, match="no architecture"):
        gguf_tensor_names(_adapter(["model.layers.0.self_attn.q_proj"]), "not-an-arch", 1)
    with pytest.raises(MemoryFormatError, match="has no GGUF name"):
        gguf_tensor_names(_adapter(["model.layers.0.self_attn.q_proj.extra"]), "qwen2", 1)
    with pytest.raises(ValueError, match="float32 or float16"):
        write_gguf_lora(
            _adapter(["model.layers.0.self_attn.q_proj"]), tmp_path / "x.gguf", arch="qwen2", n_blocks=1, dtype="int8"
        )
    plain = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "qwen2")
    plain.add_type(gguf.GGUFType.MODEL)
    plain.add_string(gguf.Keys.Adapter.TYPE, "none")
    plain.add_tensor("x", np.zeros(4, dtype=np.float32))
    plain.write_header_to_file()
    plain.write_kv_data_to_file()
    plain.write_tensors_to_file()
    plain.close()
    with pytest.raises(MemoryFormatError, match="not a GGUF LoRA adapter"):
        read_gguf_lora(tmp_path / "model.gguf")


def test_interleaving_takes_each_heads_halves_in_turn():
    rows = np.arange(8).reshape(8, 1)  # 2 heads of 4 rows: halves (0, 1 | 2, 3) and (4, 5 | 6, 7)
    assert interleave_heads(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(MemoryFormatError, match="rotary pairs"):
        interleave_heads(np.zeros((6, 1)), 2)


def _layout_check(folder, heads, kv_heads):
    """The GGUF's own query, key and value weights of layer 0 against the prepared folder's, in the layout the
    writer gives a LoRA's B for that architecture."""
    from safetensors import safe_open

    from elm_memory.models.prepare import source_gguf

    path, _ = source_gguf(folder)
    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    assert arch in INTERLEAVED_QK | HF_LAYOUT
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(f"{folder}/model.safetensors", "pt") as fh:
        for proj, n in (("q", heads), ("k", kv_heads), ("v", 0)):
            t = tensors[f"blk.0.attn_{proj}.weight"]
            ours = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape.tolist()[::-1])
            hf = fh.get_tensor(f"model.layers.0.self_attn.{proj}_proj.weight").float().numpy()
            expected = interleave_heads(hf, n) if arch in INTERLEAVED_QK and proj != "v" else hf
            assert np.abs(ours - expected).max() < 1e-6, f"{arch} {proj}: the writer's layout is not the GGUF's"


@pytest.mark.model
def test_the_writers_layout_is_the_llama_ggufs_own(tiny_loaded):
    info = tiny_loaded.info
    _layout_check(info.path, info.num_attention_heads, info.num_key_value_heads)


@pytest.mark.slow
@pytest.mark.extended
def test_the_writers_layout_is_the_qwen2_ggufs_own():
    from elm_memory.models.prepare import prepare_model

    folder = prepare_model("packaged:qwen2.5-coder-0.5b", verbose=False)
    _layout_check(folder, 14, 2)
