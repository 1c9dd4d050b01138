"""The UTF-8 bytes of every token of a tokenizer, and each token's byte span in a decoded text.

Cross-tokenizer OPD compares two tokenizations of one text, so it needs, for every token, the
exact bytes it contributes to that text. Character offsets (``return_offsets_mapping``) cannot
say that a byte-level token holds half of a multi-byte character, and the token *strings* are
spelled in each tokenizer's own alphabet (``Ġ``/``Ċ`` in byte-level BPE, ``▁`` and ``<0xNN>`` in
SentencePiece-style vocabularies). So the bytes are computed here from the token strings by
emulating the tokenizer's decoder, read from its ``tokenizers`` JSON:

* ``ByteLevel``: each character of a token is one byte of the GPT-2 byte alphabet; a token with a
  character outside that alphabet (an added token such as ``東京``) is its own UTF-8, as in the
  ``tokenizers`` decoder.
* ``Metaspace`` or ``Replace("▁", " ")``: ``▁`` is a space. ``Metaspace`` with a prepend scheme
  removes every ``▁`` of the first decoded token (that is what ``tokenizers`` does), and
  ``Strip(" ", n)`` after ``Fuse`` removes n leading spaces of the text.
* ``ByteFallback``: a ``<0xNN>`` token is the single byte NN.
* Special tokens (``all_special_ids`` and added tokens marked special: BOS, EOS, pad, template
  markers) and ids beyond the tokenizer's vocabulary have no bytes: they get an empty span and are reported, never aligned
  to text. Non-special added tokens (``<think>``) are text.

Departure from TRL's GOLD: GOLD takes a byte-level token's length to be its string length, which
only holds for byte-level BPE (its docs put SentencePiece students out of scope); here both kinds
work, and byte-fallback tokens are single bytes.

The spans index the bytes of ``tokenizer.decode(ids, skip_special_tokens=True)`` (when that
text is valid UTF-8; invalid sequences are kept as raw bytes here, where ``decode`` would put
U+FFFD). Usage::

    vb = VocabBytes.from_tokenizer(tok)
    spans = vb.spans(ids)                 # TokenSpans: .text, .spans, .special
    spans = vb.spans(ids, at_text_start=False)  # ids that continue a text (no prefix-space strip)
    response_text = vb.text(ids)          # the text to re-tokenize for the teacher
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import cast

from opd.errors import UserError

__all__ = ["TokenSpans", "VocabBytes", "byte_level_alphabet"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SUPPORTED = "ByteLevel, Metaspace, Replace('▁', ' '), ByteFallback, Fuse, Strip(' ')"


def byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte alphabet: the character that spells each byte in byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


_ALPHABET = byte_level_alphabet()


@dataclass(frozen=True)
class _Decoding:
    """What the tokenizer's decoder does to token strings, as far as bytes are concerned."""

    byte_level: bool = False
    space_char: str | None = None  # the character decoded as a space (SentencePiece's "▁")
    byte_fallback: bool = False
    strip_first_token_spaces: bool = False  # Metaspace with a prepend scheme
    strip_leading_spaces: int = 0  # Strip(" ", n) applied to the fused text


def _decoding_from_json(spec: dict | None, name: str) -> _Decoding:
    if spec is None:
        raise UserError(
            f"tokenizer {name!r} has no decoder, so its token bytes are undefined (tokenizers then joins tokens "
            f"with spaces); cross-tokenizer OPD supports decoders made of {_SUPPORTED}"
        )
    steps = spec["decoders"] if spec["type"] == "Sequence" else [spec]
    fields: dict = {}
    fused = False
    for step in steps:
        kind = step["type"]
        if kind == "ByteLevel":
            fields["byte_level"] = True
        elif kind == "Metaspace":
            fields["space_char"] = step["replacement"]
            fields["strip_first_token_spaces"] = step.get("prepend_scheme", "always") != "never"
        elif kind == "Replace" and step["content"] == " " and "String" in step["pattern"]:
            fields["space_char"] = step["pattern"]["String"]
        elif kind == "ByteFallback":
            fields["byte_fallback"] = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and step["content"] == " " and step.get("stop", 0) == 0 and fused:
            fields["strip_leading_spaces"] = int(step["start"])
        else:
            raise UserError(
                f"tokenizer {name!r} has a {kind} decoder step ({json.dumps(step)}) that cross-tokenizer OPD cannot "
                f"map to bytes; supported steps: {_SUPPORTED}. Use a byte-level BPE or SentencePiece-style tokenizer"
            )
    return _Decoding(**fields)


@dataclass(frozen=True)
class TokenSpans:
    """Byte spans of a token sequence in its decoded text.

    ``spans[i]`` is token i's [start, end) in ``text``; a special token has an empty span at the
    position where it sits and ``special[i]`` True. Text tokens can also be empty (a lone ``▁``
    stripped at the start of a SentencePiece text): they are not special.
    """

    text: bytes
    spans: tuple[tuple[int, int], ...]
    special: tuple[bool, ...]
    ids: tuple[int, ...] = ()
    at_text_start: bool = True  # whether the start-of-text rules were applied

    @property
    def special_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.special) if s]


class VocabBytes:
    """The bytes of every id of one tokenizer (None for special and unknown ids), computed once.

    Build it with :meth:`from_tokenizer`; :meth:`spans` then maps any id sequence to byte spans
    with a lookup per token.
    """

    def __init__(
        self,
        token_bytes: list[bytes | None],
        decoding: _Decoding,
        name: str = "tokenizer",
        special_names: dict[str, int] | None = None,
        byte_fallback_ids: frozenset[int] = frozenset(),
    ):
        self.token_bytes = token_bytes
        self.decoding = decoding
        self.name = name
        self.special_names = dict(special_names or {})  # special token string -> id
        self.byte_fallback_ids = byte_fallback_ids  # <0xNN> ids: a byte also spelled by a regular token

    @classmethod
    def from_tokenizer(cls, tokenizer, name: str | None = None) -> VocabBytes:
        """Read a transformers (``tokenizers``-backed) tokenizer's vocabulary and decoder."""
        name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise UserError(
                f"tokenizer {name!r} ({type(tokenizer).__name__}) has no `tokenizers` backend; cross-tokenizer OPD "
                "reads token bytes from it: load the tokenizer with AutoTokenizer (a fast tokenizer)"
            )
        decoder = backend.decoder
        decoding = _decoding_from_json(None if decoder is None else json.loads(decoder.__getstate__()), name)
        vocab = backend.get_vocab(with_added_tokens=True)
        # decode(skip_special_tokens=True) also skips added tokens marked special that are not in
        # the special-tokens map (tool-call markers and the like), so both count as special here.
        added = backend.get_added_tokens_decoder()
        special = set(tokenizer.all_special_ids) | {i for i, tok in added.items() if tok.special}
        size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
        table: list[bytes | None] = [None] * size
        names, fallback = {}, set()
        for token, i in vocab.items():
            if i in special:
                names[token] = i
                continue
            table[i] = _token_bytes(token, decoding)
            if decoding.byte_fallback and _BYTE_FALLBACK.fullmatch(token):
                fallback.add(i)
        return cls(table, decoding, name, names, frozenset(fallback))

    def __len__(self) -> int:
        return len(self.token_bytes)

    def bytes_of(self, token_id: int) -> bytes | None:
        """The bytes of one id out of context (None: special, or outside the vocabulary)."""
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else None

    def spans(self, ids, at_text_start: bool = True) -> TokenSpans:
        """Byte spans of ``ids`` (a list or 1-D tensor) in the text they decode to.

        ``at_text_start`` applies the decoder's start-of-text rules (SentencePiece's stripped
        prefix space) to the first text token; pass False for ids that continue a text, e.g. a
        response decoded together with its prompt.
        """
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        pieces: list[bytes | None] = [self.bytes_of(int(i)) for i in ids]
        if at_text_start:
            pieces = self._strip_text_start(pieces, ids)
        spans, special, pos = [], [], 0
        for piece in pieces:
            n = 0 if piece is None else len(piece)
            spans.append((pos, pos + n))
            special.append(piece is None)
            pos += n
        text = b"".join(p for p in pieces if p)
        return TokenSpans(text, tuple(spans), tuple(special), tuple(int(i) for i in ids), at_text_start)

    @property
    def has_start_rule(self) -> bool:
        """Whether a token's bytes differ at the start of a text (a stripped prefix space)."""
        return self.decoding.strip_first_token_spaces or self.decoding.strip_leading_spaces > 0

    def start_bytes_of(self, token_id: int) -> bytes | None:
        """The bytes of one id when it is the first token of a text (``▁hello`` -> b"hello")."""
        if self.bytes_of(token_id) is None:
            return None
        return self._strip_text_start([self.bytes_of(token_id)], [token_id])[0]

    def text(self, ids, at_text_start: bool = True) -> str:
        """The text to hand the other tokenizer: exactly the bytes of :meth:`spans`, as str.

        Unlike ``tokenizer.decode`` it applies no clean-up of spaces; bytes that are not valid
        UTF-8 (a response cut inside a character) become U+FFFD, which the alignment then
        reports as a byte mismatch at that point instead of aligning through it.
        """
        return self.spans(ids, at_text_start).text.decode("utf-8", errors="replace")

    def _strip_text_start(self, pieces: list[bytes | None], ids: list[int]) -> list[bytes | None]:
        first = next((i for i, p in enumerate(pieces) if p is not None), None)
        if first is None:
            return pieces
        pieces = list(pieces)
        # Metaspace drops every "▁" of the first token; a byte-fallback <0x20> is no "▁" and stays.
        if self.decoding.strip_first_token_spaces and int(ids[first]) not in self.byte_fallback_ids:
            pieces[first] = cast(bytes, pieces[first]).replace(b" ", b"")  # the first piece that is not None
        to_strip = self.decoding.strip_leading_spaces
        for i in range(first, len(pieces)):
            piece = pieces[i]
            if to_strip == 0:
                break
            if piece is None:
                continue
            cut = 0
            while cut < min(to_strip, len(piece)) and piece[cut] == 0x20:
                cut += 1
            pieces[i], to_strip = piece[cut:], to_strip - cut
            if pieces[i]:  # Strip stops at the first byte that is not a space
                break
        return pieces


def _token_bytes(token: str, decoding: _Decoding) -> bytes:
    """One token string's bytes under the decoder (out of context: no start-of-text rules)."""
    if decoding.byte_fallback:
        m = _BYTE_FALLBACK.fullmatch(token)
        if m:
            return bytes([int(m.group(1), 16)])
    if decoding.space_char is not None:
        token = token.replace(decoding.space_char, " ")
    if decoding.byte_level:
        # As the tokenizers ByteLevel decoder: a token outside the byte alphabet is its own UTF-8.
        if all(c in _ALPHABET for c in token):
            return bytes(_ALPHABET[c] for c in token)
    return token.encode("utf-8")
