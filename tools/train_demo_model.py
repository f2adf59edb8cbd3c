"""Train the engine's built-in demo model: a tiny Llama chat model, offline, on CPU.

What it does
------------
1. **Corpus.** Collects English prose that is already on this machine: the
   docstrings of the Python standard library (every module in
   ``sys.stdlib_module_names``) and of a list of well-known installed packages
   (torch, transformers, numpy, pydantic, jinja2, tqdm, ...). Source files are
   *parsed* with :mod:`ast` (``ast.get_docstring``), never imported. Docstrings
   are cleaned (doctest lines dropped, prose paragraphs re-flowed, short or
   code-heavy ones dropped), deduplicated, and capped in size.
2. **Chat data.** From the same docstrings it builds chat examples: the user
   asks "What does json.dumps do?", "Explain json.dumps.", "Tell me about the
   json module." (phrasing picked by a seeded RNG) and the assistant answers
   with the docstring's first paragraph, then ``<|end|>``. Plain text and chat
   examples are mixed about 50/50 (by characters).
3. **Tokenizer.** A byte-level BPE (``tokenizers``), 4096 tokens, with the
   special tokens ``<|endoftext|>``, ``<|user|>``, ``<|assistant|>``,
   ``<|system|>`` and ``<|end|>``, saved as ``tokenizer.json`` +
   ``tokenizer_config.json`` (``PreTrainedTokenizerFast``) with a Jinja chat
   template::

       <|user|>
       What does json.dumps do?<|end|>
       <|assistant|>
       Serialize ``obj`` to a JSON formatted ``str``.<|end|>

4. **Model.** A ``LlamaForCausalLM`` of about 4.3M parameters (hidden 256,
   4 layers, 4 heads, MLP 704, tied embeddings), trained with plain PyTorch:
   AdamW (lr 3e-3), linear warmup then cosine decay, bf16 autocast on CPU with
   fp32 master weights, batches of 8 x 256 tokens: documents packed into
   256-token sequences separated by ``<|endoftext|>``. Training stops after
   ``--minutes`` of wall time (the cosine schedule follows the clock, so it
   completes whatever the machine's speed), or after ``--steps`` steps when
   given (then the schedule follows the step count).
5. **Output.** ``save_pretrained`` in bf16 safetensors (about 9 MB), the
   tokenizer files, ``generation_config.json`` (stops at ``<|end|>`` and
   ``<|endoftext|>``) and a ``README.md`` with the numbers of this run. Then
   two greedy samples (a plain prompt and a chat prompt) are printed.

How long it takes
-----------------
About 10 minutes on 2 CPU cores with the default ``--minutes 8``: ~1 minute to
collect the corpus and train the tokenizer, 8 minutes of training (~1,300 steps
of 8 x 256 tokens, ~2.7M tokens, on two idle cores; a busy machine gets fewer),
a few seconds to save and sample. More cores or more minutes give a better
model.

How to run it
-------------
From the repository root, in the project's virtualenv::

    python tools/train_demo_model.py --out core/engine/demo_model

Options: ``--minutes`` (training wall time, default 8), ``--steps`` (fixed step
count instead, for a reproducible schedule), ``--seed`` (default 0),
``--threads`` (default 2), ``--max-chars`` (corpus cap). The corpus and
tokenizer are deterministic given the same Python and installed packages;
the time-bounded training is only as reproducible as the machine's speed
(use ``--steps`` to pin it).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
EOT, END = "<|endoftext|>", "<|end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant that knows the Python ecosystem.",
    "You are a concise assistant. Answer briefly.",
]
# Well-known installed packages whose docstrings join the corpus (best effort: missing ones are skipped).
PACKAGES = [
    "torch",
    "transformers",
    "numpy",
    "pydantic",
    "jinja2",
    "tqdm",
    "click",
    "rich",
    "pygments",
    "sympy",
    "networkx",
    "mpmath",
    "hypothesis",
    "_pytest",
    "pluggy",
    "packaging",
    "httpx",
    "httpcore",
    "anyio",
    "starlette",
    "fastapi",
    "uvicorn",
    "huggingface_hub",
    "yaml",
    "setuptools",
    "pip",
    "safetensors",
    "tokenizers",
    "filelock",
    "fsspec",
    "markdown_it",
    "typer",
    "openai",
    "idna",
    "sortedcontainers",
    "markupsafe",
    "regex",
    "prometheus_client",
    "typing_extensions",
]
SKIP_DIRS = {
    "test",
    "tests",
    "testing",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "idle_test",
    "_vendor",
    "vendor",
}
PER_PACKAGE_CHARS = 1_500_000  # so that no single package dominates the plain-text half

MODEL_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 704,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
# --architecture qwen3_5: the same width and depth as Qwen3.5's hybrid, three gated DeltaNet
# layers to one of gated attention (an engine-qwen model, for benchmarks of recurrent layers)
QWEN3_5_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "intermediate_size": 704,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
ARCHITECTURES = {"llama": ("LlamaForCausalLM", MODEL_CONFIG), "qwen3_5": ("Qwen3_5ForCausalLM", QWEN3_5_CONFIG)}
VOCAB_SIZE = 4096
SEQ_LEN = 256


# --------------------------------------------------------------------------- corpus


@dataclass
class Doc:
    name: str  # dotted name, e.g. "json.dumps"
    kind: str  # "module" | "class" | "function" | "method"
    text: str  # cleaned docstring
    source: str  # "stdlib" or the package name


_DOCTEST = re.compile(r"^\s*(>>>|\.\.\.\s|\.\.\.$)")
_UNDERLINE = re.compile(r"^\s*([=~^*#+`'\"-])\1{2,}\s*$")
_BULLET = re.compile(r"^\s*([-*+•]|\d+[.)]|[A-Za-z_][\w.]*\s*(\([^)]*\))?\s*:|:\w+)")


DEMO_SAMPLING = dict(temperature=0.5, top_k=20, top_p=0.9, repetition_penalty=1.1)


def clean_docstring(raw: str) -> str | None:
    """Clean one docstring; None when it is too short or mostly code."""
    lines = raw.strip().splitlines()
    if not lines:
        return None
    doctest = sum(1 for line in lines if _DOCTEST.match(line))
    if doctest / len(lines) > 0.3:
        return None
    lines = [line.rstrip() for line in lines if not _DOCTEST.match(line)]
    # reST headings: drop the underline and the title above it.
    kept: list[str] = []
    for line in lines:
        if _UNDERLINE.match(line):
            if kept and kept[-1].strip():
                kept.pop()
            continue
        kept.append(line)
    lines = kept
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append(current)
            current = []
    out = []
    for para in paragraphs:
        indented = any(line[:1].isspace() for line in para)
        listy = sum(1 for line in para[1:] if _BULLET.match(line))
        if not indented and not listy:
            out.append(re.sub(r"\s+", " ", " ".join(line.strip() for line in para)))
        else:  # lists, parameter sections, code blocks: keep the line structure
            out.append("\n".join(re.sub(r"(?<=\S) {2,}", " ", line) for line in para))
    text = "\n\n".join(out).strip()
    if len(text) < 40:
        return None
    letters = sum(1 for c in text if c.isalpha() or c == " ")
    if letters / len(text) < 0.7:  # mostly symbols, tables or code
        return None
    return text


def first_paragraph(text: str) -> str | None:
    """The answer of a chat example: the docstring's first prose paragraph(s), 20..700 chars."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    answer = ""
    for p in paras:
        if "\n" in p or p.rstrip().endswith(":") or p.startswith(".. "):
            break  # a list, a parameter section or a directive: stop
        answer = f"{answer} {p}".strip() if answer else p
        if len(answer) >= 60:
            break
    if not 20 <= len(answer) <= 700:
        return None
    return answer


def _module_docs(path: Path, modname: str, source: str) -> list[Doc]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
        return []
    docs: list[Doc] = []

    def add(node, name: str, kind: str) -> None:
        raw = ast.get_docstring(node, clean=True)
        if raw:
            text = clean_docstring(raw)
            if text:
                docs.append(Doc(name, kind, text, source))

    add(tree, modname, "module")

    def visit(body, prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                add(node, f"{prefix}.{node.name}", "class")
                visit(node.body, f"{prefix}.{node.name}", True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                add(node, f"{prefix}.{node.name}", "method" if in_class else "function")

    visit(tree.body, modname, False)
    return docs


def _walk_package(root: Path, base: str, source: str) -> list[Doc]:
    """Docstrings of ``root`` (a package directory or a single module file), modules in sorted order."""
    if root.is_file():
        return _module_docs(root, base, source)
    docs: list[Doc] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        for fname in sorted(filenames):
            if not fname.endswith(".py") or fname.startswith("test_"):
                continue
            parts = [base, *rel.parts]
            if fname != "__init__.py":
                parts.append(fname[:-3])
            docs.extend(_module_docs(Path(dirpath) / fname, ".".join(parts), source))
    return docs


def collect_docs() -> list[Doc]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site_dirs = []
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if p not in site_dirs:
            site_dirs.append(p)
    docs: list[Doc] = []
    n_std = 0
    for name in sorted(sys.stdlib_module_names):
        for cand in (stdlib / name, stdlib / f"{name}.py"):
            if (cand.is_dir() and (cand / "__init__.py").is_file()) or cand.is_file():
                found = _walk_package(cand, name, "stdlib")
                docs.extend(found)
                n_std += len(found)
                break
    print(f"  stdlib: {n_std} docstrings", flush=True)
    for pkg in PACKAGES:
        for site in site_dirs:
            cand = site / pkg if (site / pkg).is_dir() else site / f"{pkg}.py"
            if cand.exists():
                found = _walk_package(cand, pkg, pkg)
                docs.extend(found)
                print(f"  {pkg}: {len(found)} docstrings", flush=True)
                break
    return docs


def _is_public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


QUESTIONS = {
    "module": [
        "Tell me about the {n} module.",
        "What is the {n} module?",
        "What does the {n} module do?",
        "Explain the {n} module.",
        "What is {n} for?",
    ],
    "class": [
        "What is {n}?",
        "Explain the {n} class.",
        "Tell me about {n}.",
        "What is the {n} class used for?",
        "Describe {n}.",
    ],
    "function": [
        "What does {n} do?",
        "Explain {n}.",
        "What is {n} used for?",
        "Describe the function {n}.",
        "How does {n} work?",
        "What is the purpose of {n}?",
    ],
    "method": [
        "What does {n} do?",
        "Explain {n}.",
        "What is the {n} method for?",
        "Describe the method {n}.",
        "What is the purpose of {n}?",
    ],
}


def display_name(d: Doc) -> str:
    """How a user would name ``d``: ``json.dumps``, ``json.JSONDecoder.decode``, but ``Trainer.train``
    rather than ``transformers.trainer.Trainer.train``."""
    if d.kind == "module":
        return d.name
    parts = d.name.split(".")
    n_obj = 2 if d.kind == "method" else 1
    module, obj = parts[:-n_obj], parts[-n_obj:]
    if len(module) <= (1 if d.kind == "method" else 2):
        return d.name
    return ".".join(obj)


def chat_text(messages: list[dict]) -> str:
    """The chat template, rendered in Python (the Jinja template in tokenizer_config.json is identical)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)


def build_corpus(docs: list[Doc], max_chars: int, seed: int) -> tuple[list[str], dict]:
    """Plain-text and chat documents (each ending in ``<|endoftext|>``), shuffled with ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    unique: list[Doc] = []
    for d in docs:
        if d.text not in seen:
            seen.add(d.text)
            unique.append(d)
    rng.shuffle(unique)
    unique.sort(key=lambda d: d.source != "stdlib")  # stable: the whole standard library first, then the rest

    half = max_chars // 2
    plain: list[str] = []
    per_source: dict[str, int] = {}
    n_plain = 0
    for d in unique:
        if n_plain >= half:
            break
        if d.source != "stdlib" and per_source.get(d.source, 0) >= PER_PACKAGE_CHARS:
            continue
        per_source[d.source] = per_source.get(d.source, 0) + len(d.text)
        plain.append(d.text + EOT)
        n_plain += len(d.text)

    chat: list[str] = []
    n_chat = 0
    chat_per_source: dict[str, int] = {}
    seen_answers: set[str] = set()
    for d in unique:
        if n_chat >= half:
            break
        if not _is_public(d.name) or (d.source != "stdlib" and chat_per_source.get(d.source, 0) >= PER_PACKAGE_CHARS):
            continue
        answer = first_paragraph(d.text)
        if answer is None or answer in seen_answers:
            continue
        seen_answers.add(answer)
        name = display_name(d)
        # The standard library is what people ask about: two phrasings for each of its docstrings.
        questions = rng.sample(QUESTIONS[d.kind], 2 if d.source == "stdlib" else 1)
        for question in questions:
            messages = [{"role": "user", "content": question.format(n=name)}, {"role": "assistant", "content": answer}]
            if rng.random() < 0.1:
                messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            text = chat_text(messages)
            chat.append(text + EOT)
            n_chat += len(text)
            chat_per_source[d.source] = chat_per_source.get(d.source, 0) + len(text)

    documents = plain + chat
    rng.shuffle(documents)
    stats = {
        "docstrings": len(docs),
        "unique": len(unique),
        "plain_docs": len(plain),
        "plain_chars": n_plain,
        "chat_docs": len(chat),
        "chat_chars": n_chat,
        "total_chars": sum(len(t) for t in documents),
        "plain_chars_by_source": per_source,
        "chat_chars_by_source": chat_per_source,
    }
    return documents, stats


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    # The special tokens are separate entries; strip them from the training text.
    def texts():
        for d in documents:
            for s in SPECIAL_TOKENS:
                d = d.replace(s, "\n")
            yield d

    tok.train_from_iterator(texts(), trainer=trainer, length=len(documents))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": END,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"],
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": END, "pad_token": EOT, "additional_special_tokens": config["additional_special_tokens"]},
            indent=2,
        )
        + "\n"
    )
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    # Sanity checks: fast tokenizer, byte-level round trip, template, special tokens are single ids.
    assert hf.is_fast, type(hf)
    sample = "  Return the   JSON\n\tdocument; café ±1 →  x"
    assert hf.decode(hf.encode(sample, add_special_tokens=False)) == sample
    rendered = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|user|>\nhi<|end|>\n<|assistant|>\n", repr(rendered)
    for s in SPECIAL_TOKENS:
        assert len(hf.encode(s, add_special_tokens=False)) == 1, s
    return hf


# --------------------------------------------------------------------------- training


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="core/engine/demo_model", help="Output directory.")
    parser.add_argument(
        "--architecture",
        choices=sorted(ARCHITECTURES),
        default="llama",
        help="llama (the demo model) or qwen3_5 (a Qwen3.5 hybrid of the same size, served by engine-qwen).",
    )
    parser.add_argument("--minutes", type=float, default=8.0, help="Training wall time (default 8).")
    parser.add_argument("--steps", type=int, default=None, help="Train exactly this many steps instead of --minutes.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="Sequences of 256 tokens per step (default 8: in a few CPU minutes, many small steps "
        "reach a lower loss than fewer big ones).",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--max-chars", type=int, default=12_000_000, help="Corpus cap in characters (half plain, half chat)."
    )
    args = parser.parse_args()

    import torch
    import transformers
    from tqdm import tqdm
    from transformers import GenerationConfig

    architecture, model_config = ARCHITECTURES[args.architecture]
    model_cls = getattr(transformers, architecture)
    config_cls = transformers.LlamaConfig if args.architecture == "llama" else transformers.Qwen3_5TextConfig

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)

    print("Collecting docstrings...", flush=True)
    docs = collect_docs()
    documents, stats = build_corpus(docs, args.max_chars, args.seed)
    print(f"Corpus: {json.dumps(stats)} ({time.time() - t_start:.0f}s)", flush=True)

    print("Training the tokenizer...", flush=True)
    tok = train_tokenizer(documents, out)
    print(f"Tokenizer: {len(tok)} tokens ({time.time() - t_start:.0f}s)", flush=True)

    # Tokenize; hold out 1% of the documents for evaluation.
    n_held = max(1, len(documents) // 100)
    enc = tok._tokenizer.encode_batch(documents, add_special_tokens=False)
    held_ids = [i for e in enc[:n_held] for i in e.ids]
    train_ids = [i for e in enc[n_held:] for i in e.ids]
    stats.update(train_tokens=len(train_ids), heldout_tokens=len(held_ids))
    print(
        f"Tokens: train {len(train_ids):,}, held-out {len(held_ids):,} "
        f"({stats['total_chars'] / (len(train_ids) + len(held_ids)):.2f} chars/token, {time.time() - t_start:.0f}s)",
        flush=True,
    )

    def chunks(ids: list[int]) -> torch.Tensor:
        n = len(ids) // SEQ_LEN
        return torch.tensor(ids[: n * SEQ_LEN], dtype=torch.long).view(n, SEQ_LEN)

    train = chunks(train_ids)
    held = chunks(held_ids)

    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    config = config_cls(
        **model_config,
        vocab_size=len(tok),
        bos_token_id=ids[EOT],
        eos_token_id=ids[END],
        pad_token_id=ids[EOT],
        architectures=[architecture],
    )
    model = model_cls(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=gen)
    budget = args.minutes * 60
    warmup = 30
    total = args.steps or 0
    min_lr_frac = 0.1

    def lr_at(step: int, elapsed: float) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        if args.steps is not None:
            progress = (step - warmup) / max(total - warmup, 1)
        else:  # time-bounded: the schedule follows the wall clock, so it ends when the budget does
            progress = elapsed / budget
        progress = min(max(progress, 0.0), 1.0)
        return args.lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t_train = time.time()
    step, pos, ema = 0, 0, None
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True, mininterval=2.0)
    while True:
        elapsed = time.time() - t_train
        if args.steps is not None and step >= args.steps:
            break
        if args.steps is None and elapsed >= budget:
            break
        if args.steps is None and step in (20, 200):  # progress-bar estimate of the steps that fit the budget
            bar.total = int(budget / (elapsed / step))
            bar.refresh()
        if pos + args.batch_size > len(order):
            order, pos = torch.randperm(len(train), generator=gen), 0
        batch = train[order[pos : pos + args.batch_size]]
        pos += args.batch_size
        lr = lr_at(step, elapsed)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", refresh=False)
    bar.close()
    train_time = time.time() - t_train
    tokens_seen = step * args.batch_size * SEQ_LEN

    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [
            model(input_ids=held[i : i + 16], labels=held[i : i + 16]).loss.item()
            for i in range(0, min(len(held), 160), 16)
        ]
    held_loss = sum(losses) / len(losses)
    print(
        f"Trained {step} steps ({tokens_seen:,} tokens, {tokens_seen / max(len(train_ids), 1):.2f} epochs) "
        f"in {train_time / 60:.1f} min; final train loss (EMA) {ema:.3f}, held-out loss {held_loss:.3f}",
        flush=True,
    )

    # Save in bf16 (a few MB), with a generation config that stops at <|end|> and <|endoftext|> and
    # recommends the sampling settings a server uses when a request leaves them out: a model this small
    # rambles at temperature 1 and loops when greedy.
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[END], ids[EOT]],
        pad_token_id=ids[EOT],
        bos_token_id=ids[EOT],
        do_sample=True,
        **DEMO_SAMPLING,
    )
    model.save_pretrained(out, safe_serialization=True)
    for f in out.iterdir():  # safetensors writes 0600; the files are meant to be shipped and read by anyone
        if f.is_file():
            f.chmod(0o644)
    write_readme(out, n_params, stats, step, tokens_seen, train_time, ema, held_loss, args)

    # Two greedy samples, with transformers.
    model = model.float()
    samples = []
    plain = "The function returns"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}], tokenize=False, add_generation_prompt=True
    )
    for prompt in (plain, chat):
        input_ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            gen_ids = model.generate(
                input_ids, max_new_tokens=80, do_sample=False, attention_mask=torch.ones_like(input_ids)
            )
        text = tok.decode(gen_ids[0, input_ids.shape[1] :], skip_special_tokens=False)
        samples.append(text)
        print(f"\n--- prompt: {prompt!r}\n{text}", flush=True)
    print(f"\nDone in {(time.time() - t_start) / 60:.1f} min; model in {out}/", flush=True)


def write_readme(out: Path, n_params, stats, steps, tokens_seen, train_time, train_loss, held_loss, args) -> None:
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    architecture, c = ARCHITECTURES[args.architecture]
    text = f"""# demo_model: the engine's built-in tiny chat model

A {architecture.removesuffix("ForCausalLM")}-architecture causal LM ({n_params / 1e6:.1f}M parameters) with its own byte-level BPE
tokenizer ({VOCAB_SIZE} tokens), trained for a few minutes on CPU, offline, by
`tools/train_demo_model.py`. It is here so that the engine can serve something that answers in
recognizable English without downloading anything. It is a toy: it writes docstring-flavoured
English and does not know facts reliably.

- Architecture: `{architecture}`{" (layers: " + ", ".join(c["layer_types"]) + ")" if "layer_types" in c else ""}, hidden size {c["hidden_size"]}, {c["num_hidden_layers"]} layers,
  {c["num_attention_heads"]} attention heads ({c["num_key_value_heads"]} KV heads), MLP {c["intermediate_size"]},
  tied embeddings, max {c["max_position_embeddings"]} positions; weights stored in bf16 safetensors.
- Tokenizer: byte-level BPE, special tokens `<|endoftext|>` (pad, document separator), `<|user|>`,
  `<|assistant|>`, `<|system|>`, `<|end|>` (EOS, ends every chat turn). Chat template:
  `<|role|>\\ncontent<|end|>\\n` per message, then `<|assistant|>\\n` for the generation prompt.
- Corpus: docstrings of the Python {sys.version_info.major}.{sys.version_info.minor} standard library and of installed packages
  (torch, transformers, numpy, sympy, pydantic, jinja2, ...), parsed with `ast`, cleaned and deduplicated:
  {stats["plain_docs"]:,} plain-text documents ({stats["plain_chars"] / 1e6:.1f}M chars) and
  {stats["chat_docs"]:,} chat examples ({stats["chat_chars"] / 1e6:.1f}M chars; "What does json.dumps do?" answered
  with the docstring's first paragraph); {stats["train_tokens"]:,} training tokens, {stats["heldout_tokens"]:,} held out.
- Training: {steps} steps of {args.batch_size} x {SEQ_LEN} tokens ({tokens_seen / 1e6:.1f}M tokens), AdamW, lr {args.lr:g}
  with warmup and cosine decay, bf16 autocast, {train_time / 60:.1f} min on {args.threads} CPU threads, seed {args.seed}.
  Final train loss {train_loss:.2f}, held-out loss {held_loss:.2f}.
- Size: {size / 1e6:.1f} MB.

## Rebuild

```
python tools/train_demo_model.py --out core/engine/demo_model   # ~10 minutes on 2 CPU cores
```

The corpus depends on the installed Python and packages; training is bounded by wall time
(`--minutes`, default 8), or use `--steps N` for a fixed schedule.

## License

Apache-2.0, like the project. The weights were trained from the docstrings of the Python
standard library and of the installed packages listed above, which are distributed under their own
permissive open-source licenses.
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
