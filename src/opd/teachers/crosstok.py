"""A teacher with its own tokenizer behind :class:`opd.teachers.scoring.TeacherScorer`: cross-tokenizer OPD in the loop.

For each rollout, the messages (and tools) its prompt was rendered from -- given by the prompt set
(:meth:`CrossTokenizerTeacher.read_prompts`: a conversation reaches the teacher whole), or else
recovered from the student's prompt ids (:func:`~opd.crosstok.messages_from_prompt`) -- are read
by the teacher in its own chat template, with its own template options;
the response's exact bytes (:meth:`VocabBytes.text`) are tokenized by the teacher, with the
teacher's end token where the student's response ended with its EOS. The teacher scores its own
sequences, unchanged (:class:`opd.teachers.scoring.HFTeacher` in-process, or
:class:`opd.teachers.client.HTTPTeacher` for a served teacher); the two tokenizations are aligned by
bytes (:func:`~opd.crosstok.align_ids`) and the scores are moved into the student's frame, so the
loop and the losses are those of ordinary OPD:

* ``topk_ids_NTK`` / ``topk_logprobs_NTK``: at a student position paired with a teacher position
  (``pairing="group_start"``, the default: the first student token of each aligned group with
  the group's first teacher token, both predicted from the same text prefix; ``"one_to_one"``:
  one-to-one groups only), the teacher's top-K mapped into the student vocabulary by bytes
  (:func:`opd.losses.cross.cross_tokenizer_support`), with the teacher's log-probs. A slot whose
  token has no student counterpart holds log-prob -inf, which LSM leaves out of the support, so
  the ordinary LSM loss renormalizes over the mapped part of the teacher's top-K.
  For a teacher whose tokens run longer than the student's (its "15" for the student's "1" "5"):
  ``pairing="within_group"`` also gives the later student tokens of a group with one teacher token
  the teacher's distribution at the group's start, kept where it goes on past the group's bytes so
  far; ``joinable="drop"`` leaves out of a position's support the student tokens the teacher's
  tokenizer would have joined to its token before (after its "1", a "5": it would have written
  "15", so its near-zero probability there is about a boundary it never makes, not the text).
* ``sampled_logprobs_NT``: the student's own log-prob plus the span reward
  (:func:`opd.losses.cross.span_reward`), so that "teacher minus student" -- what sampled-token
  OPD and the reward diagnostics read -- is the group's reward on its last student token and 0 on
  its other tokens. For a one-to-one group it is the teacher's log-prob of the same bytes.
* ``position_mask_NT``: the positions with a teacher signal for the objective (lsm: paired and
  with a mapped top-K token; sampled: inside an aligned group). The trainer takes the others out
  of the loss and logs their share (``cross/dropped``); they are tokens inside a many-to-many
  group, special tokens without a partner, and the tokens that overlap bytes the teacher reads
  differently (a byte token that is not UTF-8 reaches the teacher as U+FFFD): the alignment
  re-synchronises after such a stretch (``on_mismatch="resync"``), so the rest of the response
  keeps its signal.
* ``metrics``: ``cross/one_to_one`` (share of response positions aligned one-to-one) and
  ``cross/mapped_mass`` (share of the teacher's top-K mass that maps into the student vocabulary).

With identical vocabularies (``--cross-tokenizer on`` and the student's own tokenizer) the teacher
reads the student's response ids as sampled: re-tokenizing would replace a sampled segmentation by
the canonical one, and ordinary OPD scores the sampled one. Its scores then equal ordinary OPD's.

Not supported (refused by :func:`opd.config.check_cross_tokenizer`): full_kl and the supports that
need the teacher's log-probs of student-chosen tokens, which have no teacher counterpart in
general; multi-turn episodes (``--env``), whose environment turns would need re-rendering per turn.
"""

from __future__ import annotations

import math
import warnings
from typing import cast

import torch

from opd.crosstok.align import PAIRINGS, Alignment, align_ids, alignment_tensors
from opd.crosstok.template import messages_from_prompt, render_for_teacher, teacher_prompt_and_response_ids
from opd.crosstok.token_bytes import VocabBytes
from opd.crosstok.vocab_map import JOINABLE, build_vocab_map, longest_prefix_id, student_ids_by_bytes
from opd.errors import UserError
from opd.losses import Head
from opd.losses.cross import cross_tokenizer_support, mapped_topk_mass, one_to_one_share, span_reward
from opd.objectives import CROSS_TOKENIZER_GIVES, TOPK, ObjectiveOptions, lookup, usable_with
from opd.rollout.prompt_set import PromptSet
from opd.rollout.sampling import RolloutBatch, left_pad
from opd.teachers.scoring import TeacherScorer, TeacherScores

__all__ = ["CrossTokenizerTeacher"]


def _name(tok) -> str:
    return getattr(tok, "name_or_path", "") or type(tok).__name__


class CrossTokenizerTeacher:
    """Scores rollouts with a teacher that tokenizes differently; see the module docstring.

    ``inner`` scores sequences of teacher token ids (an ``HFTeacher`` of the teacher model, or an
    ``HTTPTeacher`` built with the teacher's tokenizer). ``special_map``: student special token
    name -> teacher special token name; the student's EOS defaults to the teacher's EOS.
    ``teacher_rows``: the teacher head's size when it exceeds its tokenizer (padded embeddings).
    ``teacher_context``: the teacher model's positions, checked against each sequence in its own
    tokenization (None for a served teacher, whose server bounds what it reads).
    """

    def __init__(
        self,
        inner: TeacherScorer,
        student_tok,
        teacher_tok,
        *,
        objective: str = "lsm",
        pairing: str = "group_start",
        unmapped: str = "drop",
        joinable: str = "keep",
        special_map: dict[str, str] | None = None,
        teacher_rows: int | None = None,
        teacher_context: int | None = None,
    ):
        # the config has refused the supports this teacher cannot score, so teacher_topk stands for them
        needs = lookup(objective).needs(ObjectiveOptions(objective, support="teacher_topk"))
        if not needs <= CROSS_TOKENIZER_GIVES:
            raise UserError(f"a cross-tokenizer teacher trains {usable_with(CROSS_TOKENIZER_GIVES)}, not {objective}")
        # The top-K objectives (lsm) read the mapped top-K at aligned positions; the others the
        # sampled token's reward per aligned span.
        self.reads_topk = TOPK in needs
        self.inner, self.student_tok, self.teacher_tok = inner, student_tok, teacher_tok
        self.pairing, self.teacher_context = pairing, teacher_context
        for name, value, choices in (("cross_pairing", pairing, PAIRINGS), ("cross_joinable", joinable, JOINABLE)):
            if value not in choices:
                raise UserError(f"{name}={value!r}: choose one of {', '.join(choices)}")
        self.joinable = joinable
        self._join_prefixes: frozenset[bytes] | None = None
        self._s_ids: dict[bytes, int] | None = None  # student bytes -> id, for targets inside groups
        self._s_longest = 0
        self.s_vb = VocabBytes.from_tokenizer(student_tok, f"student {_name(student_tok)}")
        self.t_vb = VocabBytes.from_tokenizer(teacher_tok, f"teacher {_name(teacher_tok)}")
        self.vmap = build_vocab_map(
            self.s_vb,
            self.t_vb,
            special_pairs=self._special_pairs(special_map or {}),
            teacher_rows=teacher_rows,
            unmapped=unmapped,
        )
        self.same_vocab = student_tok.get_vocab() == teacher_tok.get_vocab()
        self.student_eos = student_tok.eos_token_id
        self.end_token = teacher_tok.convert_ids_to_tokens(self.vmap.special_pairs[self.student_eos])
        # A teacher template without a user role fails here, before any model work.
        render_for_teacher(teacher_tok, [{"role": "user", "content": "1 + 1 = ?"}])
        self._prompts: dict[tuple[int, ...], tuple[list[dict], tuple | None]] = {}  # prompt ids -> messages, tools
        self._warned_mismatch = False

    def _special_pairs(self, special_map: dict[str, str]) -> dict[str, str]:
        """``build_vocab_map``'s special_pairs (teacher name -> student name); EOS pairs with EOS by default."""
        s_eos, t_eos = self.student_tok.eos_token, self.teacher_tok.eos_token
        by_name = s_eos in self.t_vb.special_names
        pairs = {} if by_name or s_eos in special_map else {t_eos: s_eos}
        pairs.update({t: s for s, t in special_map.items()})
        return pairs

    @property
    def notice(self) -> str:
        """The one line ``opd train`` prints when it detects (or is told of) the teacher's tokenizer."""
        what = "cross-tokenizer LSM" if self.reads_topk else "cross-tokenizer sampled-token OPD (span reward)"
        differs = "is the student's (forced on)" if self.same_vocab else "differs from the student's"
        prefix = f" ({self.vmap.n_prefix} more to the student token they begin with)" if self.vmap.n_prefix else ""
        longer = self.vmap.n_teacher_text - self.vmap.n_mapped
        all_on = self.vmap.n_prefix and self.pairing == "within_group" and self.joinable == "drop"
        hint = ""
        if self.reads_topk and longer and not all_on:  # the collapse of docs/cross-tokenizer.md
            hint = (
                f"; {longer} teacher tokens have no student token of the same bytes: if the student's text shrinks "
                "to what aligns one to one (cross/one_to_one rising to 1), use --cross-unmapped prefix "
                "--cross-pairing within_group --cross-joinable drop (docs/cross-tokenizer.md)"
            )
        return (
            f"teacher tokenizer {differs}: {self.vmap.n_mapped} of {self.vmap.n_teacher_text} teacher tokens map "
            f"to student tokens{prefix}; {what}{hint}"
        )

    # ------------------------------------------------------------------ teacher sequences

    def read_prompts(self, prompts: PromptSet) -> None:
        """The messages and tools each prompt of ``prompts`` was rendered from, kept by its ids: the
        teacher then renders a conversation whole and lists its tools, where inverting the student's
        template recovers a user turn after an optional system turn only."""
        for example, ids in zip(prompts.examples, prompts.prompt_ids, strict=True):
            self._prompts[tuple(ids)] = (example.chat(), example.tools)

    def _messages(self, prompt: tuple[int, ...]) -> tuple[list[dict], tuple | None]:
        if prompt not in self._prompts:  # prompts recur across steps and samples
            text = self.student_tok.decode(list(prompt), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._prompts[prompt] = (messages_from_prompt(self.student_tok, text), None)
        return self._prompts[prompt]

    def _teacher_row(self, batch: RolloutBatch, n: int) -> tuple[list[int], list[int], list[int]]:
        """Row n's teacher prompt ids, teacher response ids and student response ids."""
        P = batch.prompt_len
        prompt = batch.input_ids_NL[n, :P][batch.attention_mask_NL[n, :P].bool()].tolist()
        response = batch.response_ids_NT[n, : int(batch.response_mask_NT[n].sum())].tolist()
        ended = bool(response) and response[-1] == self.student_eos
        messages, tools = self._messages(tuple(prompt))
        t_prompt, t_response = teacher_prompt_and_response_ids(
            self.teacher_tok, messages, self.s_vb.text(response), self.end_token if ended else None, tools=tools
        )
        if self.same_vocab:  # the sampled segmentation, as ordinary OPD scores it (module docstring)
            t_response = response
        return t_prompt, t_response, response

    def _teacher_batch(self, rows, device) -> RolloutBatch:
        """The teacher's sequences as a rollout batch: left-padded prompts, then the responses."""
        pad = self.teacher_tok.pad_token_id if self.teacher_tok.pad_token_id is not None else 0
        ids_NP, attn_NP = left_pad([p for p, _, _ in rows], pad)
        U = max(1, max(len(r) for _, r, _ in rows))
        resp_NU = torch.full((len(rows), U), pad, dtype=torch.long, device="cpu")
        mask_NU = torch.zeros(len(rows), U, dtype=torch.bool, device="cpu")
        for n, (_, r, _) in enumerate(rows):
            resp_NU[n, : len(r)] = torch.tensor(r, dtype=torch.long, device="cpu")
            mask_NU[n, : len(r)] = True
        return RolloutBatch(
            torch.cat([ids_NP, resp_NU], 1).to(device),
            torch.cat([attn_NP, mask_NU.long()], 1).to(device),
            ids_NP.shape[1],
            resp_NU.to(device),
            mask_NU.to(device),
            torch.zeros(len(rows), U, device=device),
            torch.zeros(len(rows), dtype=torch.bool, device=device),
        )

    def _check_context(self, rows) -> None:
        """The teacher reads each sequence in its own tokens, which may be more than the student's."""
        longest = max(len(p) + len(r) for p, r, _ in rows)
        if self.teacher_context and longest > self.teacher_context:
            raise UserError(
                f"the teacher's tokenizer ({self.t_vb.name}) makes a prompt and response {longest} tokens long, more "
                f"than the teacher model's context of {self.teacher_context} positions; lower --max-new-tokens or "
                "--max-prompt-tokens (the teacher may need more tokens than the student for the same text)"
            )

    def _check_alignments(self, alignments: list[Alignment]) -> None:
        """Warn once when a response's bytes differ for the teacher (the tokens where they differ are left out)."""
        bad = sum(al.mismatch_at is not None for al in alignments)
        if bad and not self._warned_mismatch:
            self._warned_mismatch = True
            warnings.warn(
                f"{bad} of {len(alignments)} responses read differently after the teacher's tokenizer "
                f"({self.t_vb.name}) encoded them: bytes that are not UTF-8 (an untrained model's byte tokens, a "
                "response cut inside a character), a normalizer, or text without a teacher token (unknown-token "
                "fallback). The positions whose bytes differ are left out of the loss (cross/dropped) and the "
                "alignment resumes after them; a teacher tokenizer with byte fallback and no normalizer avoids the "
                "last two",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def score(self, batch: RolloutBatch, k: int, query_ids_NTQ=None, diag_index_M=None) -> TeacherScores:
        """The teacher's scores in the student's frame; no full-vocabulary diagnostic logits."""
        if query_ids_NTQ is not None:
            raise UserError(
                "a cross-tokenizer teacher cannot score student-chosen tokens (student-side supports); "
                "use --support teacher_topk"
            )
        device = batch.response_ids_NT.device
        rows = [self._teacher_row(batch, n) for n in range(batch.num_rollouts)]
        self._check_context(rows)
        t_batch = self._teacher_batch(rows, device)
        teacher = self.inner.score(t_batch, k)
        alignments = [
            align_ids(s, t, self.s_vb, self.t_vb, on_mismatch="resync", special_pairs=self.vmap.special_pairs)
            for _, t, s in rows
        ]
        self._check_alignments(alignments)
        T, U = batch.response_ids_NT.shape[1], t_batch.response_ids_NT.shape[1]
        idx = alignment_tensors(alignments, T, U, pairing=self.pairing, device=device)
        return self._student_frame(batch, teacher, idx, rows, alignments)

    def _within_groups(self, rows, alignments, teacher: TeacherScores, K: int):
        """Targets for the later student tokens of each group with one teacher token (the student's
        "5" of "15", where the teacher wrote "15"): the teacher's top-K at the group's start, kept
        where a token's bytes go on past the student's bytes so far in the group, each token's mass
        counted for the student token its remaining bytes begin with (the longest that is a
        prefix), so the distribution is the teacher's over how the text goes on.

        Returns {(n, t): (student ids, log-masses)}, at most K ids a position."""
        if self._s_ids is None:
            self._s_ids = student_ids_by_bytes(self.s_vb)
            self._s_longest = max(map(len, self._s_ids), default=0)
        t_ids, t_lp = teacher.topk_ids_NTK.tolist(), teacher.topk_logprobs_NTK.tolist()
        out = {}
        for n, ((_, _, response), al) in enumerate(zip(rows, alignments, strict=True)):
            for g in al.groups:
                if len(g.teacher) != 1 or len(g.student) < 2 or g.teacher_shift:
                    continue
                u, done = g.teacher[0], b""
                for i, j in zip(g.student[:-1], g.student[1:], strict=True):
                    done += self.s_vb.bytes_of(response[i]) or b""
                    mass: dict[int, float] = {}
                    for tid, lp in zip(t_ids[n][u], t_lp[n][u], strict=True):
                        tb = self.t_vb.bytes_of(tid)
                        if lp == -math.inf or not tb or len(tb) <= len(done) or not tb.startswith(done):
                            continue
                        sid = longest_prefix_id(tb[len(done) :], self._s_ids, self._s_longest)
                        if sid >= 0:
                            mass[sid] = mass.get(sid, 0.0) + math.exp(lp)
                    if mass:
                        top = sorted(mass.items(), key=lambda kv: -kv[1])[:K]
                        out[(n, j)] = ([sid for sid, _ in top], [math.log(m) for _, m in top])
        return out

    def _joinable(self, rows, teacher_pos_NT: torch.Tensor, ids_NTK: torch.Tensor, valid_NTK: torch.Tensor):
        """The valid support slots whose student token the teacher's tokenizer would have joined to the
        teacher token before the position: their bytes after that token's begin a teacher token.

        The teacher predicts from its own tokens: after its "1" it reads the number as ended (its
        tokenizer writes "15" as one token), so its probability of the student's "5" there is that
        of a segmentation it never makes, not of the text going on with "5" (near 0 where the text
        very likely does). Shapes: teacher_pos_NT (N, T); ids_NTK, valid_NTK (N, T, K) -> (N, T, K)."""
        if self._join_prefixes is None:  # every proper and whole prefix of a teacher token, 2 bytes or more
            self._join_prefixes = frozenset(b[:i] for b in self.t_vb.token_bytes if b for i in range(2, len(b) + 1))
        prefixes = self._join_prefixes
        joined = torch.zeros_like(valid_NTK)
        pos, ids, valid = teacher_pos_NT.tolist(), ids_NTK.tolist(), valid_NTK.tolist()
        for n, (t_prompt, t_response, _) in enumerate(rows):
            for t, u in enumerate(pos[n]):
                if u < 0 or not any(valid[n][t]):
                    continue
                before = self.t_vb.bytes_of(t_response[u - 1] if u > 0 else t_prompt[-1])
                for j, sid in enumerate(ids[n][t]):
                    tail = self.s_vb.bytes_of(sid) if valid[n][t][j] else None
                    if before and tail and before + tail in prefixes:
                        joined[n, t, j] = True
        return joined

    def _student_frame(self, batch: RolloutBatch, teacher: TeacherScores, idx, rows, alignments) -> TeacherScores:
        """Teacher-frame scores (N, U, K) moved to student positions (N, T, K); see the module docstring."""
        vmap = self.vmap.to(batch.response_ids_NT.device)
        mask_NT = cast(torch.Tensor, batch.action_mask_NT).bool()  # set by RolloutBatch.__post_init__
        at = (idx.teacher_pos_BT, vmap.teacher_to_student_V, mask_NT, idx.text_start_BT)
        ids_NTK, lp_NTK, valid_NTK, lsm_NT, _ = cross_tokenizer_support(
            teacher.topk_ids_NTK, teacher.topk_logprobs_NTK, *at, vmap.teacher_to_student_start_V
        )
        if self.pairing == "within_group" and self.reads_topk:  # the span reward has its own groups
            K = ids_NTK.shape[-1]
            for (n, t), (sids, lps) in self._within_groups(rows, alignments, teacher, K).items():
                if not mask_NT[n, t]:
                    continue
                ids_NTK[n, t] = torch.tensor(sids + [0] * (K - len(sids)), dtype=ids_NTK.dtype)
                lp_NTK[n, t] = torch.tensor(lps + [-math.inf] * (K - len(lps)), dtype=lp_NTK.dtype)
                valid_NTK[n, t] = torch.arange(K, device=valid_NTK.device) < len(sids)
                lsm_NT[n, t] = True
        if self.joinable == "drop" and self.reads_topk:
            valid_NTK = valid_NTK & ~self._joinable(rows, idx.teacher_pos_BT, ids_NTK, valid_NTK)
            lsm_NT = lsm_NT & valid_NTK.any(-1)
        reward_NT = span_reward(
            batch.logprobs_NT, teacher.sampled_logprobs_NT, idx.student_group_BT, idx.teacher_group_BU, mask_NT
        )
        grouped_NT = mask_NT & (idx.student_group_BT >= 0)
        mapped = mapped_topk_mass(teacher.topk_ids_NTK, teacher.topk_logprobs_NTK, *at, vmap.teacher_to_student_start_V)
        return TeacherScores(
            topk_ids_NTK=ids_NTK,
            topk_logprobs_NTK=lp_NTK.masked_fill(~valid_NTK, -math.inf),
            sampled_logprobs_NT=(batch.logprobs_NT + reward_NT).to(teacher.sampled_logprobs_NT.dtype),
            position_mask_NT=lsm_NT if self.reads_topk else grouped_NT,
            metrics={
                "cross/one_to_one": float(one_to_one_share(idx.one_to_one_BT, mask_NT)),
                "cross/mapped_mass": float(mapped),
            },
        )

    def hidden_and_head(self, batch: RolloutBatch) -> tuple[torch.Tensor, Head]:
        raise UserError(
            "full_kl needs the teacher's distribution over the student's vocabulary, which a teacher with "
            f"another tokenizer does not have; use {usable_with(CROSS_TOKENIZER_GIVES)}"
        )
