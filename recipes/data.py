"""Real data that ships with the installed packages, so recipes run offline.

Also random token ids (``kind: random``) for the benchmark regimes.

Text: the English help topics in the standard library's ``pydoc_data`` (~470 kB), tokenized
with a byte-level BPE trained on the fly by ``tokenizers``. Images: scikit-learn's bundled 8x8
handwritten digits (1,797 images, 10 classes). Splits are fixed by seed, and every per-item
random choice (BERT masking) is seeded by the item index, so any two strategies see identical
batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([pydoc_text()], trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def token_stream(vocab_size: int) -> torch.Tensor:
    """The help text as token ids (memoised: a Hydra process that prepared it before forking
    a job's workers hands it to them; recipes/agent.py)."""
    tok = train_tokenizer(vocab_size)
    return torch.tensor(tok.encode(pydoc_text()).ids, dtype=torch.long)


def split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(n * val_fraction))
    return order[n_val:], order[:n_val]


class CausalChunks(Dataset):
    """Non-overlapping windows of the token stream; labels = inputs (the model shifts)."""

    def __init__(self, chunks: torch.Tensor) -> None:
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.chunks[i]
        return {"input_ids": ids, "labels": ids}


class MaskedChunks(Dataset):
    """BERT masked-LM: 15 % of positions are predicted; of those 80 % become [MASK], 10 % a
    random token, 10 % stay unchanged (Devlin et al.). [CLS] ... [SEP] framing."""

    def __init__(self, chunks: torch.Tensor, vocab_size: int, seed: int, mask_prob: float = 0.15):
        self.chunks, self.vocab_size = chunks, vocab_size
        self.seed, self.mask_prob = seed, mask_prob
        self.cls, self.sep, self.mask = (SPECIAL.index(t) for t in ("[CLS]", "[SEP]", "[MASK]"))

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        body = self.chunks[i].clone()
        labels = torch.full_like(body, -100)
        chosen = torch.rand(len(body), generator=gen) < self.mask_prob
        labels[chosen] = body[chosen]
        action = torch.rand(len(body), generator=gen)
        to_mask = chosen & (action < 0.8)
        to_random = chosen & (action >= 0.8) & (action < 0.9)
        body[to_mask] = self.mask
        body[to_random] = torch.randint(len(SPECIAL), self.vocab_size, (int(to_random.sum()),),
                                        generator=gen)
        ids = torch.cat([torch.tensor([self.cls]), body, torch.tensor([self.sep])])
        labels = torch.cat([torch.tensor([-100]), labels, torch.tensor([-100])])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class Digits(Dataset):
    def __init__(self, images: torch.Tensor, targets: torch.Tensor) -> None:
        self.images, self.targets = images, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[i], "labels": self.targets[i]}


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    vocab_size: int | None = None


def text_splits(kind: str, vocab_size: int, seq_len: int, val_fraction: float,
                seed: int) -> Splits:
    """GPT ("causal") or BERT ("masked") datasets; BERT chunks leave room for [CLS]/[SEP]."""
    stream = token_stream(vocab_size)
    body = seq_len if kind == "causal" else seq_len - 2
    chunks = stream[: len(stream) // body * body].view(-1, body)
    train_idx, val_idx = split(len(chunks), val_fraction, seed)
    if kind == "causal":
        return Splits(CausalChunks(chunks[train_idx]), CausalChunks(chunks[val_idx]), vocab_size)
    return Splits(MaskedChunks(chunks[train_idx], vocab_size, seed),
                  MaskedChunks(chunks[val_idx], vocab_size, seed + 1), vocab_size)


def random_splits(vocab_size: int, seq_len: int, samples: int, val_fraction: float,
                  seed: int) -> Splits:
    """Uniformly random token ids (the benchmark regimes' data: nothing to learn, so the
    loss stays near ln(vocab); what is measured is the systems' cost on fixed shapes).
    Seeded, so every strategy sees the same sequences."""
    gen = torch.Generator().manual_seed(seed)
    chunks = torch.randint(0, vocab_size, (samples, seq_len), generator=gen)
    train_idx, val_idx = split(samples, val_fraction, seed)
    return Splits(CausalChunks(chunks[train_idx]), CausalChunks(chunks[val_idx]), vocab_size)


def digit_splits(image_size: int, val_fraction: float, seed: int) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        images = torch.nn.functional.interpolate(images, size=image_size, mode="bilinear",
                                                 align_corners=False)
    images = (images - images.mean()) / images.std()
    targets = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = split(len(targets), val_fraction, seed)
    return Splits(Digits(images[train_idx], targets[train_idx]),
                  Digits(images[val_idx], targets[val_idx]))
