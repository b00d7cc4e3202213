"""Real-text data for the utility experiment: Debian packages -> text -> splits ->
SentencePiece tokenizer -> uint16/uint32 token shards. Run through scripts/prepare_data.sh.

  python scripts/prepare_data.py --out ~/.cache/collider/data [--sample] [--debs DIR]

Sources (apt-get download + dpkg-deb -x; no root install):
  curated domain  python3.11-doc: the reStructuredText sources of Python's official documentation
                  (_sources/**/*.rst.txt; the 3 MB whatsnew/changelog excluded)
  noisy mixture   libpython3.11-stdlib (Python source code), manpages + manpages-dev (raw troff),
                  linux-libc-dev (C headers), each package's Debian changelog and copyright file,
                  plus the documentation pieces not used by the curated split (in-domain text inside
                  the broad mixture, as OpenWebMath holds math for RHO-1)
Files are cut into pieces of about 8 KB at blank lines; a stable hash of (file, piece) assigns each
piece to one split, so the splits never share text:
  curated_train  40% of the documentation pieces (the reference model's training data)
  curated_eval   10% of the documentation pieces (held-out curated-domain evaluation)
  mix_train      the other 50% of the documentation pieces + the noisy sources (95%)
  mix_eval       5% of the mixture pieces (held-out general evaluation)
Outputs in --out: tokenizer.model (SentencePiece BPE, byte fallback, identity normalisation so that
any UTF-8 text round-trips), <split>.bin (header + token ids; documents joined with EOS),
<split>.txt.sample (first 2 KB of the split's text), meta.json (sources, versions, sizes).
The .deb files and their extracted trees are cached in --debs (shared by every output directory).
Shard header (32 bytes, little endian): magic "CLDRTOK1", u32 version 1, u32 bytes per token (2|4),
u64 number of tokens, u32 vocab size, u32 eos id. Read by harness/components/token_data.h.
--sample: a few dozen pieces per split and a 1000-piece vocabulary (tests; seconds).
Concurrency: every file is written under a temporary name in its own directory and renamed, so a
reader never sees half of one; an flock on OUT/.lock (and on DEBS/.lock for the download and
extraction) makes a second preparation of the same directory wait for the first, then find it
complete (tests/test_prepare_data.cpp starts two at once).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import gzip
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

PACKAGES = {
    "python3.11-doc": "curated",
    "libpython3.11-stdlib": "noise",
    "manpages": "noise",
    "manpages-dev": "noise",
    "linux-libc-dev": "noise",
}
# Byte caps per noisy source (full mode), so that the mixture stays modest and balanced.
NOISE_CAP_BYTES = {"libpython3.11-stdlib": 9_000_000, "manpages": 3_000_000, "manpages-dev": 4_000_000,
                   "linux-libc-dev": 4_000_000, "debian-meta": 1_000_000}
PIECE_BYTES = 8192
MAGIC = b"CLDRTOK1"


def log(msg):
    print(f"[prepare_data] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(directory: str, what: str):
    """Holds an exclusive flock on DIRECTORY/.lock (the file keeps the holder's pid, for the message);
    a second process waits here until the first is done. The kernel drops the lock when its holder
    dies, so a killed preparation never blocks the next one."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            log(f"{what}: waiting for the preparation holding {path} (pid {holder})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_atomic(path: str, data: bytes):
    """Writes DATA to a temporary name beside PATH, fsyncs it and renames it over PATH."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_stale(directory: str, prefix: str):
    """Removes leftovers of killed preparations (temporary names starting with PREFIX); called
    under the directory's lock, so no live writer owns them."""
    for name in os.listdir(directory):
        if name.startswith(prefix):
            p = os.path.join(directory, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)


def bucket(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 100


def download(debs_dir: str) -> dict:
    os.makedirs(debs_dir, exist_ok=True)
    found = {}
    missing = []
    for pkg in PACKAGES:
        hits = sorted(glob.glob(os.path.join(debs_dir, f"{pkg}_*.deb")))
        if hits:
            found[pkg] = hits[-1]
        else:
            missing.append(pkg)
    if missing:
        log(f"apt-get download {' '.join(missing)} -> {debs_dir}")
        # apt-get writes into its working directory as it downloads: a private directory, whose
        # complete files are then renamed into the cache (a reader never sees a partial .deb).
        tmp = tempfile.mkdtemp(prefix=".download-", dir=debs_dir)
        try:
            r = subprocess.run(["apt-get", "download", *missing], cwd=tmp, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"error: apt-get download {' '.join(missing)} failed:\n{r.stderr}\n"
                      "Put the .deb files in the --debs directory by hand on a machine without network.",
                      file=sys.stderr)
                sys.exit(3)  # tests skip (with this message) on exit code 3: no network and no cached .debs
            for pkg in missing:
                hits = sorted(glob.glob(os.path.join(tmp, f"{pkg}_*.deb")))
                if not hits:
                    sys.exit(f"error: apt-get download {pkg} reported success but wrote no {pkg}_*.deb")
                found[pkg] = os.path.join(debs_dir, os.path.basename(hits[-1]))
                os.replace(hits[-1], found[pkg])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return found


def extract(deb: str, dest: str) -> str:
    """dpkg-deb -x into a temporary directory beside DEST, renamed to DEST when complete (call under
    the .deb cache's lock). DEST/.extracted marks a tree complete; a tree without it (left by an
    older version of this script) is replaced."""
    stamp = os.path.join(dest, ".extracted")
    if os.path.exists(stamp):
        return dest
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.tmp-", dir=parent)
    r = subprocess.run(["dpkg-deb", "-x", deb, tmp], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"error: dpkg-deb -x {deb} failed: {r.stderr.strip()}\n(a damaged download? delete {deb} and rerun)")
    open(os.path.join(tmp, ".extracted"), "w").close()
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return dest


def fetch_and_extract(debs_dir: str) -> tuple:
    """Downloads the missing .deb files into the cache and extracts each one, under the cache's lock
    (several preparations share one cache). Returns ({package: .deb path}, {package: tree})."""
    with locked(debs_dir, "deb cache"):
        remove_stale(debs_dir, ".download-")
        debs = download(debs_dir)
        work = os.path.join(debs_dir, "extract")
        os.makedirs(work, exist_ok=True)
        remove_stale(work, ".")  # only temporary trees start with a dot
        roots = {pkg: extract(deb, os.path.join(work, pkg)) for pkg, deb in debs.items()}
    return debs, roots


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def pieces(text: str):
    """Cuts text into pieces of about PIECE_BYTES at blank lines (hard cut for huge paragraphs)."""
    out, cur, size = [], [], 0
    for para in text.split("\n\n"):
        while len(para) > 4 * PIECE_BYTES:
            out.append(para[:PIECE_BYTES])
            para = para[PIECE_BYTES:]
        cur.append(para)
        size += len(para) + 2
        if size >= PIECE_BYTES:
            out.append("\n\n".join(cur))
            cur, size = [], 0
    if cur and "".join(cur).strip():
        out.append("\n\n".join(cur))
    return [p for p in out if p.strip()]


def source_files(pkg: str, root: str):
    if pkg == "python3.11-doc":
        files = glob.glob(os.path.join(root, "usr/share/doc/python3.11/html/_sources/**/*.rst.txt"), recursive=True)
        return sorted(f for f in files if not f.endswith("whatsnew/changelog.rst.txt"))
    if pkg == "libpython3.11-stdlib":
        return sorted(f for f in glob.glob(os.path.join(root, "usr/lib/python3.11/**/*.py"), recursive=True)
                      if "/test/" not in f)
    if pkg in ("manpages", "manpages-dev"):
        return sorted(glob.glob(os.path.join(root, "usr/share/man/man*/*.gz")))
    if pkg == "linux-libc-dev":
        return sorted(glob.glob(os.path.join(root, "usr/include/**/*.h"), recursive=True))
    raise ValueError(pkg)


def meta_files(root: str):
    return sorted(glob.glob(os.path.join(root, "usr/share/doc/*/changelog.Debian.gz")) +
                  glob.glob(os.path.join(root, "usr/share/doc/*/copyright")))


def collect(roots: dict, sample: bool):
    """Returns {split: [text pieces]} and per-source byte counts (ROOTS: the extracted trees)."""
    splits = {"curated_train": [], "curated_eval": [], "mix_train": [], "mix_eval": []}
    stats = {}
    noise_pieces = []  # (key, text)
    sample_cap = 40  # pieces per source in --sample mode
    for pkg, role in PACKAGES.items():
        root = roots[pkg]
        files = source_files(pkg, root)
        n_bytes = n_pieces = 0
        cap = NOISE_CAP_BYTES.get(pkg, None) if role == "noise" else None
        rng = random.Random(pkg)
        if role == "noise":
            rng.shuffle(files)  # a cap takes a random subset of files, not the alphabetical head
        for f in files:
            if os.path.islink(f) or not os.path.isfile(f):
                continue
            rel = os.path.relpath(f, root)
            for i, p in enumerate(pieces(read_text(f))):
                if sample and n_pieces >= sample_cap:
                    break
                if cap is not None and n_bytes >= cap:
                    break
                key = f"{pkg}/{rel}#{i}"
                n_bytes += len(p.encode())
                n_pieces += 1
                if role == "curated":
                    b = bucket(key)
                    if b < 10:
                        splits["curated_eval"].append(p)
                    elif b < 50:
                        splits["curated_train"].append(p)
                    else:
                        noise_pieces.append((key, p))
                else:
                    noise_pieces.append((key, p))
        stats[pkg] = {"files": len(files), "pieces": n_pieces, "bytes": n_bytes}
        # Debian changelog / copyright of every package: short, noisy, real.
        for f in meta_files(root):
            if os.path.islink(f) or not os.path.isfile(f):
                continue
            rel = os.path.relpath(f, root)
            for i, p in enumerate(pieces(read_text(f))):
                if sample and i >= 2:
                    break
                noise_pieces.append((f"{pkg}/{rel}#{i}", p))
    for key, p in noise_pieces:
        (splits["mix_eval"] if bucket("mix:" + key) < 5 else splits["mix_train"]).append(p)
    # Document order inside a split: seeded shuffle (token windows then mix sources).
    for name, docs in splits.items():
        random.Random(name).shuffle(docs)
    return splits, stats


def train_tokenizer(splits, out: str, vocab: int, sample: bool):
    import sentencepiece as spm

    model_path = os.path.join(out, "tokenizer.model")
    if os.path.exists(model_path):
        log(f"tokenizer: {model_path} exists (delete it to retrain)")
        return model_path
    # Training text: the two training splits, one line per text line (SentencePiece reads lines).
    lines = [ln for d in splits["curated_train"] + splits["mix_train"] for ln in d.split("\n") if ln.strip()]
    random.Random(0).shuffle(lines)
    lines = lines[: (20000 if sample else 400000)]
    t0 = time.time()
    # Trained in a temporary directory, then renamed. The model records its model_prefix, so a
    # relative one ("tokenizer", from inside that directory) keeps the file the same wherever it is made.
    tmp = tempfile.mkdtemp(prefix=".tokenizer.tmp.", dir=out)
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_prefix="tokenizer", vocab_size=vocab,
            model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
            character_coverage=0.9995, max_sentence_length=16384, num_threads=2, minloglevel=2,
            hard_vocab_limit=not sample, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    finally:
        os.chdir(cwd)
    for ext in ("vocab", "model"):  # the model last: its presence means a trained tokenizer
        with open(os.path.join(tmp, f"tokenizer.{ext}"), "rb") as f:
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, f"tokenizer.{ext}"), os.path.join(out, f"tokenizer.{ext}"))
    os.rmdir(tmp)
    log(f"tokenizer: trained {vocab} pieces on {len(lines)} lines in {time.time() - t0:.1f} s")
    return model_path


def write_shard(path: str, ids, vocab: int, eos: int):
    import numpy as np

    dtype = np.uint16 if vocab <= 65536 else np.uint32
    arr = np.asarray(ids, dtype=dtype)
    write_atomic(path, MAGIC + struct.pack("<IIQII", 1, arr.itemsize, arr.size, vocab, eos) + arr.tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--debs", default=None, help="where .deb files are cached (default OUT/debs)")
    ap.add_argument("--sample", action="store_true", help="small sample (tests)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; 1000 with --sample)")
    args = ap.parse_args()
    out = os.path.abspath(os.path.expanduser(args.out))
    with locked(out, "output directory"):
        prepare(out, args)


def prepare(out: str, args):
    """The whole preparation of OUT, called under OUT's lock."""
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        log(f"{meta_path} exists: data ready (delete {out} to rebuild)")
        return
    remove_stale(out, ".tokenizer.tmp.")
    for name in os.listdir(out):
        if ".tmp." in name and os.path.isfile(os.path.join(out, name)):  # left by a killed preparation
            os.unlink(os.path.join(out, name))
    vocab = args.vocab or (1000 if args.sample else 8192)
    debs, roots = fetch_and_extract(os.path.abspath(os.path.expanduser(args.debs or os.path.join(out, "debs"))))
    splits, stats = collect(roots, args.sample)
    model_path = train_tokenizer(splits, out, vocab, args.sample)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_path)
    meta = {"format": "CLDRTOK1", "vocab_size": sp.get_piece_size(), "eos_id": sp.eos_id(),
            "tokenizer": "tokenizer.model", "sample": args.sample,
            "packages": {p: os.path.basename(d) for p, d in debs.items()}, "sources": stats, "splits": {}}
    for name, docs in splits.items():
        t0 = time.time()
        enc = sp.encode(docs, num_threads=2)
        ids = []
        for e in enc:
            ids.extend(e)
            ids.append(sp.eos_id())
        write_shard(os.path.join(out, f"{name}.bin"), ids, sp.get_piece_size(), sp.eos_id())
        write_atomic(os.path.join(out, f"{name}.txt.sample"), "\n\n".join(docs)[:2048].encode())
        n_bytes = sum(len(d.encode()) for d in docs)
        meta["splits"][name] = {"pieces": len(docs), "bytes": n_bytes, "tokens": len(ids)}
        log(f"{name}: {len(docs)} pieces, {n_bytes / 1e6:.2f} MB, {len(ids)} tokens ({time.time() - t0:.1f} s)")
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())  # written last: its presence marks complete data
    log(f"done: {out}")


if __name__ == "__main__":
    main()
