"""builtin:tiny: deterministic build, standard Hugging Face form, byte-level tokenizer with a chat template."""

import hashlib

from cluster.inputs.builtin_model import build, resolve_model_path


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_builds_byte_identical_twice(tmp_path):
    build("tiny", tmp_path / "a")
    build("tiny", tmp_path / "b")
    a, b = digests(tmp_path / "a"), digests(tmp_path / "b")
    assert set(a) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json"}
    assert a == b


def test_resolve_builds_once_and_passes_other_paths_through(tiny_path):
    assert resolve_model_path("builtin:tiny") == tiny_path
    assert resolve_model_path("/models/Qwen3-1.7B") == "/models/Qwen3-1.7B"


def test_a_build_says_so_in_one_line_and_a_cached_model_says_nothing(tmp_path, monkeypatch, capsys):
    """A first use of builtin:small was 50 s of silence: the build is said on stderr, once."""
    monkeypatch.setenv("RAYSWEEP_CACHE", str(tmp_path))
    path = resolve_model_path("builtin:tiny")
    out, err = capsys.readouterr()
    target = tmp_path / "builtin-tiny-v1"
    assert path == str(target) and out == ""
    assert err == f"[raysweep] building builtin:tiny (first use; cached under {target})\n"
    assert resolve_model_path("builtin:tiny") == path
    assert capsys.readouterr() == ("", "")


def test_loads_in_transformers(tiny_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_path)
    assert config.model_type == "llama" and config.vocab_size == 264
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = "naïve {\"k\": 1}\n"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per byte, no BOS added
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi<|end|><|assistant|>"
    assert tok.eos_token_id == 256 and tok.pad_token_id == 257
