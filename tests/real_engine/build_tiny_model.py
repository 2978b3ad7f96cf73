"""Build the real-engine suite's model: a tiny random-weight Llama and a small byte-level BPE
tokenizer, made here from a seeded corpus (nothing is downloaded from a model hub).

    .venv-vllm/bin/python tests/real_engine/build_tiny_model.py .cache/tiny-llama

Run with .venv-vllm's python (it has torch, transformers and tokenizers); ~10 s on 2 cores.
The sizes are the smallest vLLM's CPU backend serves: its attention kernel refuses a head
size of 16, so two heads of 64 make the hidden size of 128. The weights are random, so the
text is gibberish; what the tests need is a real engine's scheduling, streaming, errors and
metrics, not sense. Seeded, so two builds give the same model.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024
SEED = 7
WORDS = ("the quick brown fox jumps over lazy dog hello world what who wrote answer question "
         "knowledge cache route proxy model token stream").split()
# One message per line: "role: content", then "assistant:" to prompt the answer.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def corpus(rng: random.Random) -> list[str]:
    """Word salad over a small vocabulary, plus printable-ASCII noise so any text tokenizes."""
    sentences = [" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(2000)]
    noise = ["".join(chr(rng.randrange(32, 127)) for _ in range(80)) for _ in range(500)]
    return sentences + noise


def train_tokenizer(rng: random.Random):  # -> tokenizers.Tokenizer (imported lazily)
    """The byte-level BPE tokenizer, with `tokenizers` alone (no transformers needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(rng), trainer)
    # What transformers' save_pretrained writes for it: no special tokens added to a prompt.
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    return tok


def build_tokenizer(rng: random.Random):  # -> PreTrainedTokenizerFast (imported lazily)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(rng), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tokenizer_files(out: Path) -> Path:
    """Only what the proxy reads of the model directory (PROXY_AFFINITY_TOKENIZER): the same
    tokenizer.json and chat template as the full build, with `tokenizers` alone, ~0.3 s. For
    tests and benchmarks that tokenize as the tiny model's engine does without .venv-vllm."""
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(random.Random(SEED)).save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return out


def build_model(vocab_size: int, bos_token_id: int, eos_token_id: int):  # -> LlamaForCausalLM
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=2048, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, torch_dtype="float32")
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).to(torch.float32)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(random.Random(SEED))
    tokenizer.save_pretrained(out)
    model = build_model(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    model.save_pretrained(out, safe_serialization=True)
    print(f"built {out}: vocab {len(tokenizer)}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
