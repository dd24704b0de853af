"""The embedded demo model: a small Llama-architecture checkpoint made locally.

Nothing is downloaded. The checkpoint is built deterministically from a fixed seed
(transformers ``LlamaConfig`` + random weights, a byte-level BPE tokenizer built with
``tokenizers``), saved once into a cache directory and reused. The same spec and seed
always give the same bytes, so tests can compare SGLang against transformers on it.

Invariants:
- ``num_key_value_heads`` is divisible by every TP degree Flying may form on a node of
  up to 4 engines (GQA views need ``H_kv % m == 0``).
- float32 weights, so greedy outputs of SGLang on CPU equal transformers exactly.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: Bump when the recipe below changes, so stale caches are not reused.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class DemoSpec:
    """Shape of a demo checkpoint. The defaults are the embedded demo model."""

    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    init_std: float = 0.08
    seed: int = 0

    def key(self) -> str:
        """A short name unique to this spec and recipe, used as the cache folder name."""
        return (
            f"llama-h{self.hidden_size}-l{self.num_hidden_layers}-a{self.num_attention_heads}"
            f"-kv{self.num_key_value_heads}-i{self.intermediate_size}-v{self.vocab_size}"
            f"-s{self.seed}-r{RECIPE_VERSION}"
        )


DEFAULT_SPEC = DemoSpec()

# The byte-level alphabet is the whole vocabulary's base; these specials come after it.
BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A fixed corpus for the BPE merges: the tokenizer only needs to be deterministic and
# byte-complete, not good.
_CORPUS = [
    "Flying binds data-parallel engines into tensor-parallel groups and releases them.",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello, world! How are you today? I am a small language model made of random numbers.",
    "def main():\n    print('hello')\n    return 0\n",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "The capital of France is Paris. The capital of Italy is Rome.",
]


def default_cache_dir() -> Path:
    """Where demo checkpoints live: $FLYING_CACHE_DIR, else ~/.cache/flying."""
    env = os.environ.get("FLYING_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "flying"


def _build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries or fewer.

    Training is single-threaded over a fixed corpus, hence deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def _write(spec: DemoSpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = _build_tokenizer(spec.vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    (out / "flying_demo.json").write_text(json.dumps({"recipe": RECIPE_VERSION, **asdict(spec)}))


def ensure_demo_model(spec: DemoSpec = DEFAULT_SPEC, cache_dir: Path | None = None) -> Path:
    """Return the checkpoint directory for ``spec``, creating it on first use.

    Creation writes into a temporary sibling and renames it into place, so concurrent
    callers (test workers, two launches) never see a half-written checkpoint.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = root / spec.key()
    if (out / "flying_demo.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{spec.key()}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    _write(spec, tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its checkpoint is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Create the Flying demo checkpoint.")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    print(ensure_demo_model(cache_dir=args.cache_dir))


if __name__ == "__main__":
    main()
