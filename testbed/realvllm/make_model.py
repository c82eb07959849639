"""Write a tiny random-weight Llama checkpoint that the real vLLM can load and serve: run with the image's venv.

`python make_model.py OUT_DIR` writes config.json, generation_config.json, model.safetensors and a tokenizer trained
here on a fixed text (BPE, vocab 512), so nothing comes from a hub. Seeded: the same venv writes the same bytes.
Sized for the CPU testbed (under 1 MB): hidden 128, 2 layers, 4 heads, 2 KV heads (tensor parallel 2 needs the
KV heads divisible by 2), bfloat16. The weights are random: completions are gibberish, but the same at TP 1 and
TP 2, which is what a serving check needs.

Run by testbed/realvllm/image.py with the venv's python, not imported by the testbed itself (torch lives only
in that venv).
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "The reconciler keeps two DGX Spark nodes serving one model over a RoCE link.",
    "Tensor parallel rank one runs headless on the worker; rank zero serves the API on the head.",
    "Unified memory means the KV cache and the weights share one pool with everything else.",
    "Hello world. The quick brown fox jumps over the lazy dog. 0123456789",
] * 20


def tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="bfloat16",
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    print(json.dumps(sorted(p.name for p in out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
