"""Long-context retrieval tasks, generated here (no downloads), and how to score them.

Three synthetic tasks in the spirit of passkey retrieval and RULER; each builds a long
*context* (instructions plus a haystack of repeated filler sentences with facts hidden
in it) and one *query* per hidden fact:

  passkey   one line "The pass key is 12345. Remember it." at one depth; the question
            asks for the pass key. One query.
  niah      RULER-style needles with distractors: one line "The special magic number for
            WORD is: 1234567." per requested depth, each with its own key word and value;
            one query per needle (the other needles are its distractors).
  vt        variable tracking: per requested depth a chain `VAR A = 12345`, then (later in
            the haystack) `hops` assignments `VAR B = VAR A`, ...; one query per chain,
            "what is the value of" its last variable. Every chain holds a different number, so copying any
            number from the context is right 1 / n_chains of the time (the chance level).
            This is the form chosen for a 135M model: a value lookup one hop deep (default),
            answered by copying digits (RULER's form, listing every variable that holds a
            value, asks for names and is out of reach for such a model).

Generators are tokenizer-agnostic: they take an `encode(text) -> ids` function only to fit
the filler to a target token count, and return text plus the expected answer. The prompt
is `prefix` (instructions + haystack) followed by a query's `tail` (question and the
answer's opening words, e.g. "The pass key is"); `n_tokens` is len(encode(prefix)) +
len(encode(tail)) for the longest tail, at most `target` and within one filler sentence of
it. A `Template` wraps the prompt in a chat format (`CHATML` for SmolLM2-Instruct; `OWN`,
params.template=model: the model's own chat template from its metadata, `own_template`).

What the cache sees. In kvjax a chunk of tokens fed in one call attends to its own fresh
K/V; only *later* calls read K/V back through the cache codec. If prefix and question went
in as one prefill, a lossy cache would never touch the first answer token. So
`answer_through_cache` feeds the prefix first, then the query's tail as its own call, then
decodes greedily: every token of the tail and of the answer reads the prefix's K/V through
the codec (tests/lab/test_tasks.py holds that this differs from a one-shot prefill under int2).
The prefix itself is prefilled at full precision and then stored through the codec
(`encode_prefix`), which is KIVI's protocol (full-precision prefill, compressed cache) and
lets one fp32 prefill serve every cache setting: storing the fp32 K/V through a codec is
the same write a prefill with that codec makes.

Through an eviction policy (`cache.policy`): the prefix goes in ONE call through an fp32
cache with its queries kept (`prefill_queries`; snapkv, h2o and tova score tokens by the
attention of prefix queries, which a chunked prefill would scatter over calls), its K/V are
stored through the setting's codec and compacted to the budget (`evict_prefix`), and the
question and answer read the compacted cache. The selection sees the prefix alone: the
question comes after it, so no policy is query-aware here. One such prefill serves every
policy and codec (a call's queries and fresh K/V do not depend on the codec), and the cache
is the one `kvjax.decode.evict.prefill` returns for the prefix (tests/lab/test_tasks.py).

Scoring (`score`): the first run of digits in the generated text must equal the answer
exactly (so "123456" does not count for "12345").

Question-aware eviction (`aware`): the question is fed through the prefix's fp32 cache with
its queries kept, so the policy scores context and question together and compacts the
whole prompt; the answer's first token comes from the uncompacted prompt, the rest read
the compacted cache (`continue_greedy`).

Modules: `haystack` (the passkey/niah/vt generators, templates and `score`), `ruler` (the
RULER-style suite: eleven tasks in three families, scored by the share of expected strings)
and `through_cache` (prefilling, storing the prefix through a codec or compacting it, and
answering); this face re-exports the first and the last.
"""

from kvjax.lab.tasks.haystack import (
    BASE, CHATML, FILLER, GEMMA, OWN, PLAIN, TASKS, TEMPLATES, WORDS, Example, Query, Template,
    check_args, generate, own_template, score)
from kvjax.lab.tasks.through_cache import (
    Prefix, Prompt, answer_through_cache, aware, continue_greedy, encode_prefix, evict_prefix,
    prefill, prefill_queries, prefix_kv, question_prompt)

__all__ = ["BASE", "CHATML", "FILLER", "GEMMA", "OWN", "PLAIN", "TASKS", "TEMPLATES", "WORDS",
           "Example", "Prefix", "Prompt", "Query", "Template", "answer_through_cache", "aware",
           "check_args", "continue_greedy", "encode_prefix", "question_prompt",
           "evict_prefix", "generate", "own_template", "prefill", "prefill_queries",
           "prefix_kv", "score"]
