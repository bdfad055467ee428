"""Real text for the Hugging Face runs: fortunes from Debian's `fortunes` package, labelled by
their file (0: computers, 1: science), and a WordPiece tokenizer trained on them locally with
`tokenizers` (no hub is reachable). The tokenizer's training breaks ties between equally frequent
merges differently from run to run, so it is trained once (`python3 fortune_data.py DIR` saves it)
and every rank of every run loads that one; the data and its order are fixed."""
import os

FORTUNES = "/usr/share/games/fortunes"
CATEGORIES = ("computers", "science")


def fortunes(category, limit):
    with open(os.path.join(FORTUNES, category), encoding="utf-8", errors="replace") as f:
        texts = [t.strip() for t in f.read().split("\n%\n") if t.strip()]
    return texts[:limit]


def labelled(limit=512):
    """[(text, label)], the categories interleaved."""
    per = [fortunes(c, limit) for c in CATEGORIES]
    rows = []
    for i in range(min(len(p) for p in per)):
        rows += [(per[label][i], label) for label in range(len(per))]
    return rows


def train_tokenizer(texts, vocab_size=2000):
    """A BERT-style WordPiece tokenizer, as transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special,
                                                             show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls),
                                                                                                ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


class Encoded:
    """A map-style dataset of tokenized fortunes: input_ids, attention_mask, labels."""

    def __init__(self, rows, tokenizer, max_length=64):
        import torch
        enc = tokenizer([t for t, _ in rows], truncation=True, max_length=max_length, padding="max_length",
                        return_tensors="pt")
        self.items = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
                       "labels": torch.tensor(label)} for i, (_, label) in enumerate(rows)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def small_bert(vocab_size):
    """A BERT-style sequence classifier from a config (2 layers, 128 wide)."""
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=64, num_labels=len(CATEGORIES),
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def load_tokenizer(directory):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(directory)


if __name__ == "__main__":
    import sys
    train_tokenizer([t for t, _ in labelled()]).save_pretrained(sys.argv[1])
