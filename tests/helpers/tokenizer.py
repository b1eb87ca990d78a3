"""A character-level Hugging Face fast tokenizer that fits the tiny test models (vocab 128, pad 0, bos 1, eos 2).

Printable ASCII, newline and tab keep their code points as ids (so a failing test's token ids read as text:
97 is "a", 10 is a newline); every other character becomes UNK_ID. No id reaches 128, and the tokenizer adds
no special tokens on its own. It is built with the `tokenizers` library and saved through transformers, so
`AutoTokenizer.from_pretrained(path)` loads it like any model's tokenizer (nothing downloaded).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
CHARACTERS = "\t\n" + "".join(chr(code) for code in range(32, 127))


def save_char_tokenizer(path: str | Path) -> Path:
    """Write the character-level tokenizer into the folder `path` (created if missing) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {**SPECIAL_TOKENS, **{char: ord(char) for char in CHARACTERS}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # one piece per character; `[\s\S]` rather than `.`, which would leave newlines out of the pieces
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # join the characters back without spaces between them
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return path
