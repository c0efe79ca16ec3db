"""Tokenizer goldens for ferrolm, from transformers.

Run from the repository root (needs transformers >= 5, tokenizers, gguf):

    python3 tools/oracle/tokenizer_golden.py \
        [--gguf ~/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--name smollm2]

Writes crates/engine/tests/goldens/tokenizer_<name>.json (ids, decodes, chat templates) and
crates/engine/tests/goldens/<name>_tokenizer/ (tokenizer_config.json and chat_template.jinja as
transformers saves them; tokenizer.json is too large to commit, the Rust test writes it).

Reference: transformers' own GGUF loader, `AutoTokenizer.from_pretrained(dir, gguf_file=name)`.
It ignores `tokenizer.ggml.pre = "smollm"` and gives plain ByteLevel pre-tokenization, while
SmolLM2's tokenizer.json (and llama.cpp's "smollm" rule) first splits every digit on its own
(`Digits(individual_digits=True)` then `ByteLevel`). We trust SmolLM2's tokenizer.json: the script
sets that pre-tokenizer on the loaded tokenizer, and prints every case where the unpatched
transformers tokenizer disagrees (so the difference is visible, not hidden).

A second, synthetic vocabulary covers the SentencePiece ("llama") path: the script trains a
400-piece SentencePiece BPE model (byte fallback, a user-defined `<tool>`), writes its vocabulary
as crates/engine/tests/goldens/tiny_spm.gguf (tokens, scores, token types, no tensors) and takes
transformers' GGUF tokenizer for it as the reference (HF's score-derived merges). Cases where
sentencepiece itself tokenizes differently are printed, not hidden.

special=false is transformers' `split_special_tokens=True`; decode is
`decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`.
"""

import argparse
import json
import os
import sys

import gguf
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDENS = os.path.join(ROOT, "crates", "engine", "tests", "goldens")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    'fn main() {\n\tprintln!("{}", 1 + 2);\n}',
    "12345 3.14",
    "Call 555-0199 or +1 (800) 123-4567; pi=3.14159, 2024-01-01",
    "multiple   spaces    and\n\n\nnewlines\t\ttabs  \n  ",
    "   leading and trailing   ",
    "Café naïve résumé façade Ångström",
    "你好，世界！日本語のテキスト。한국어 텍스트",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "مرحبا بالعالم שלום עולם",
    "<|im_start|>user\nHi<|im_end|>",
    "text with <|endoftext|> inside",
    "<|im_start|><|im_end|><|endoftext|>",
    "Superscripts x² + y³ = z¹ and ½ cup, ٣ apples, area 5 ²",
    "",
    "Mixed: HTTP/1.1 200 OK — “quotes” ‘single’ … ellipsis",
    "नमस्ते दुनिया สวัสดีชาวโลก",
    "I'm, you're, they'll, we've, she'd, IT'S",
    "https://example.com/path?q=1&r=2#frag",
    "<|im_start partial and <|im_end|",
    "nul\u0000byte and bell\u0007",
]

CHATS = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "user", "content": "Hello!"}], False),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}], True),
    (
        [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi 👋"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Say <|im_end|> literally."},
        ],
        True,
    ),
    (
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "second"},
            {"role": "user", "content": "  third\n"},
        ],
        False,
    ),
]


# Gemma 3: its SentencePiece vocabulary stores whitespace runs, newline runs and HTML tags as
# user-defined tokens, and its turn markers as control tokens.
GEMMA_TEXTS = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "a  b   c    d\t\te",
    "<table><tr><td>x</td></tr></table>",
    "  indented\n\n\nthree newlines",
    "x" + " " * 40 + "y" + " " * 33,
    "    def f():\n        return  1",
]

SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you doing today?",
    "def tokenize(text): return text.split()",
    "Numbers like 12345 and 3.14159 appear in text.",
    "Café naïve résumé — accents are common in French words.",
    "Sentences with    multiple spaces and\nnewlines\tand tabs.",
]

SPM_TEXTS = [
    "Hello world",
    "Hello  world 123 ü 😀",
    " leading space",
    "  two leading",
    "a\nb\tc",
    "<s>hi</s> <tool> x",
    "tokenize the quick brown fox",
    "你好 Ωmega",
    "",
]

SPM_CHATS = [([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], False)]


def write_tiny_spm(path):
    """Train a small SentencePiece BPE model and store its vocabulary the way llama.cpp does."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 20), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<tool>"], unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif piece == "<tool>":
            types.append(4)
        else:
            types.append(1)
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp


def make_golden(gguf_path, name, texts, chats, sp=None):
    reader = gguf.GGUFReader(gguf_path)
    field = lambda k: reader.fields[k].contents() if k in reader.fields else None
    pre = field("tokenizer.ggml.pre")
    d, f = os.path.split(gguf_path)
    raw = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)

    # The conversion must reproduce the file's vocabulary exactly.
    tokens = field("tokenizer.ggml.tokens")
    vocab = tok.get_vocab()
    assert len(vocab) == len(tokens), (len(vocab), len(tokens))
    # (Gemma files store whitespace-run tokens as real spaces; transformers respells them "▁▁".)
    respell = lambda t: "\u2581" * len(t) if " " in t and not t.strip() else t
    assert all(vocab.get(t, vocab.get(respell(t))) == i for i, t in enumerate(tokens)), "vocabulary ids differ"

    if pre == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )

    encode = []
    for text in texts:
        ids_special = tok.encode(text, add_special_tokens=True)
        ids_plain = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        for kind, ids, r in (
            ("special", ids_special, raw.encode(text, add_special_tokens=True)),
            ("plain", ids_plain, raw.encode(text, add_special_tokens=False, split_special_tokens=True)),
        ):
            if ids != r:
                print(f"{name}: transformers' GGUF tokenizer differs ({kind}) on {text!r}:\n  {r}\n  {ids}", file=sys.stderr)
        if sp is not None and sp.encode(text) != ids_plain:
            print(f"{name}: sentencepiece differs on {text!r}:\n  {sp.encode(text)}\n  {ids_plain}", file=sys.stderr)
        dec = lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        encode.append(
            {
                "text": text,
                "ids_special": ids_special,
                "ids_plain": ids_plain,
                "decode_special": dec(ids_special),
                "decode_plain": dec(ids_plain),
            }
        )

    chat = []
    for messages, gen in chats:
        out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        chat.append({"messages": messages, "add_generation_prompt": gen, "text": out})

    golden = {
        "source": f,
        "vocab_size": len(tokens),
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos": bool(field("tokenizer.ggml.add_bos_token")),
        "encode": encode,
        "chat": chat,
    }
    os.makedirs(GOLDENS, exist_ok=True)
    path = os.path.join(GOLDENS, f"tokenizer_{name}.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(golden, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    return tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.expanduser("~/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--name", default="smollm2")
    args = ap.parse_args()

    tok = make_golden(args.gguf, args.name, TEXTS, CHATS)

    # The directory form, minus tokenizer.json (about 3.5 MB).
    out_dir = os.path.join(GOLDENS, f"{args.name}_tokenizer")
    tmp = os.path.join(out_dir, ".tmp")
    tok.save_pretrained(tmp)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tmp, name)):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    for name in os.listdir(tmp):
        os.remove(os.path.join(tmp, name))
    os.rmdir(tmp)
    print(f"wrote {out_dir}: {sorted(os.listdir(out_dir))}")

    gemma = os.path.join(os.path.dirname(args.gguf), "gemma-3-270m-q4_k_m.gguf")
    if os.path.exists(gemma):
        make_golden(gemma, "gemma3", TEXTS + GEMMA_TEXTS, [])
    else:
        print(f"{gemma} not found: tokenizer_gemma3.json not regenerated", file=sys.stderr)

    spm_path = os.path.join(GOLDENS, "tiny_spm.gguf")
    sp = write_tiny_spm(spm_path)
    make_golden(spm_path, "tiny_spm", SPM_TEXTS, SPM_CHATS, sp)


if __name__ == "__main__":
    main()
