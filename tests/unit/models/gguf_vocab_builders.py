"""Tokenizer-only GGUF files the way llama.cpp's converter writes them, from small vocabularies
trained here: SentencePiece style (`tokenizer.ggml.model` = "llama": ▁ pieces, <0x..> byte
tokens, scores, token types) in Mixtral's, Phi-3's and Gemma 3's layouts, and byte-level BPE
("gpt2") split the way Qwen2/Qwen3 split. Each file sits alone in its folder, as transformers'
`AutoTokenizer.from_pretrained(folder, gguf_file=...)` wants it.
"""
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
GGUF_NAME = "tokenizer.gguf"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "Hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "hello world and the world says hello there",
    "The year 2024 had 366 days; numbers like 1234567 and 3.14159 appear often.",
    "héllo wörld, café crème brûlée, naïve façade, déjà vu.",
    "世界你好，今天天气很好。我们去公园吧。",
    "Привет, мир! Как дела? مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # ok\n\nclass A:\n    pass\n",
    "I'm sure they'll've done it, don't you? We're here. IT'S LOUD.",
    "  two  spaces\n\n\tnew line and tab   three   spaces",
    "user: what is 2+2? assistant: 4. user: and 3+3? assistant: 6.",
]
TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "héllo wörld, café crème brûlée",
    "世界你好，今天天气很好。",
    "Emoji: 🎉🤖👍🏽 and ZWJ 👩‍💻",
    "Привет, мир! مرحبا بالعالم",
    "two  spaces\n\n\tnew line and tab  ",
    "I'm sure they'll've done it, DON'T you?",
    "def f(x):\n    return x ** 2  # ok",
    "digits 0123456789 and 42",
    "x",
]
LEADING_SPACE_TEXTS = ["  two leading spaces", " one", "\n starts with a newline"]


def train_pieces(pre_tokenizer, normalizer=None, vocab_size: int = 600, alphabet=()) -> list[str]:
    """The vocabulary a BPE trainer learns from CORPUS, in id order (alphabet first, then merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, initial_alphabet=list(alphabet))
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    vocab = tokenizer.get_vocab()
    return sorted(vocab, key=vocab.get)


def sentencepiece_pieces() -> list[str]:
    """▁-marked pieces, as SentencePiece learns them: a space becomes ▁ and starts a piece."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return train_pieces(pre_tokenizers.Split("▁", behavior="merged_with_next"), normalizer)


def write_sentencepiece_gguf(folder: Path, layout: str, pieces: list[str], **metadata) -> Path:
    """A SentencePiece GGUF in `layout` ("mixtral", "phi3" or "gemma3"): special tokens where that
    family keeps them, each piece scored by its training order (better first), as llama.cpp's
    converter copies SentencePiece's scores. Extra `metadata` keys are written as given."""
    vocab = _LAYOUTS[layout](pieces)
    arch = {"mixtral": "llama", "phi3": "phi3", "gemma3": "gemma3"}[layout]
    ids = {token: index for index, (token, _, _) in enumerate(vocab)}
    keys = {
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.bos_token_id": ids["<bos>" if layout == "gemma3" else "<s>"],
        "tokenizer.ggml.eos_token_id": ids["<eos>" if layout == "gemma3" else "</s>"],
        "tokenizer.ggml.unknown_token_id": ids["<unk>"],
    }
    if layout == "gemma3":
        keys["tokenizer.ggml.padding_token_id"] = ids["<pad>"]
        keys["tokenizer.ggml.add_space_prefix"] = False
    keys.update(metadata)
    return write_tokenizer_gguf(folder, arch, "llama", vocab, keys)


def write_byte_level_gguf(folder: Path, arch: str, pre: str, **metadata) -> Path:
    """A byte-level BPE GGUF split with Qwen2's regex, with Qwen's special tokens after the pieces."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), byte_level])
    pieces = train_pieces(pre_tokenizer, alphabet=pre_tokenizers.ByteLevel.alphabet())
    vocab = [(piece, 0.0, NORMAL) for piece in pieces]
    vocab += [(token, 0.0, CONTROL) for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    vocab += [(token, 0.0, USER_DEFINED) for token in ("<think>", "</think>")]
    ids = {token: index for index, (token, _, _) in enumerate(vocab)}
    keys = {"tokenizer.ggml.pre": pre, "tokenizer.ggml.merges": _byte_level_merges(pieces),
            "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"], "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
            "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"], "tokenizer.ggml.add_bos_token": False}
    keys.update(metadata)
    return write_tokenizer_gguf(folder, arch, "gpt2", vocab, keys)


def write_tokenizer_gguf(folder: Path, arch: str, model: str, vocab: list[tuple[str, float, int]],
                         metadata: dict) -> Path:
    """`vocab` as (token, score, token type) rows; `metadata` values typed by their Python type.
    A one-row embedding is the only tensor: transformers reads no weights for a tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / GGUF_NAME
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(model)
    writer.add_token_list([token for token, _, _ in vocab])
    writer.add_token_scores([score for _, score, _ in vocab])
    writer.add_token_types([kind for _, _, kind in vocab])
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab), 1), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_level_merges(pieces: list[str]) -> list[str]:
    """The merges that built each learned piece, in learning order: the first split of a piece
    into two earlier pieces (a BPE trainer's vocabulary holds both halves of each merge)."""
    earlier: set[str] = set()
    merges = []
    for piece in pieces:
        split = next((cut for cut in range(1, len(piece)) if piece[:cut] in earlier and piece[cut:] in earlier), None)
        if len(piece) > 1 and split is not None:
            merges.append(f"{piece[:split]} {piece[split:]}")
        earlier.add(piece)
    return merges


def _bytes() -> list[tuple[str, float, int]]:
    return [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]


def _scored(pieces: list[str]) -> list[tuple[str, float, int]]:
    return [(piece, -float(rank), NORMAL) for rank, piece in enumerate(pieces)]


def _mixtral(pieces: list[str]) -> list[tuple[str, float, int]]:
    head = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    return head + _bytes() + _scored(pieces)


def _phi3(pieces: list[str]) -> list[tuple[str, float, int]]:
    chat = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
    return (_mixtral(pieces) + [(token, 0.0, CONTROL) for token in chat]
            + [("<|placeholder1|>", 0.0, UNUSED)])


def _gemma3(pieces: list[str]) -> list[tuple[str, float, int]]:
    """Gemma's order: pad, eos, bos, unk, mask, the chat markers, then (user-defined, stored with
    real spaces by the converter, scored -1000) runs of spaces, bytes, pieces."""
    head = [("<pad>", 0.0, CONTROL), ("<eos>", 0.0, CONTROL), ("<bos>", 0.0, CONTROL), ("<unk>", 0.0, UNKNOWN),
            ("<mask>", 0.0, CONTROL), ("<start_of_turn>", 0.0, CONTROL), ("<end_of_turn>", 0.0, CONTROL)]
    spaces = [(" " * n, -1000.0, USER_DEFINED) for n in range(2, 6)]
    return head + spaces + _bytes() + _scored(pieces)


_LAYOUTS = {"mixtral": _mixtral, "phi3": _phi3, "gemma3": _gemma3}
