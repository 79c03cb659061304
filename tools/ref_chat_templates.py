#!/usr/bin/env python3
"""Chat templates rendered by Jinja2, the engine Hugging Face's apply_chat_template runs (NOT run
by CI; output committed): tests/fixtures/chat_templates_ref.jsonl, one line per (template,
conversation, add_generation_prompt) with the rendered text, and for Gemma the token ids
llama.cpp gives that text (special tokens parsed, no BOS added: the template writes it).

The template texts are the models' published tokenizer_config.json chat_template values:
Gemma 3 (google/gemma-3-*-it), Gemma 2 (google/gemma-2-*-it), Llama 3 (meta-llama/Meta-Llama-3-8B-Instruct), Llama 2
(meta-llama/Llama-2-7b-chat-hf), Mistral (mistralai/Mistral-7B-Instruct-v0.1 and v0.2) and
Phi-3 (microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct), with each model's BOS and EOS
texts.

Templates too long to keep here are files under tests/fixtures/chat_templates/ (lines for them
name the file in "source_file" instead of carrying "source"): Llama 3.1 (also 3.3's, the same
text) and Llama 3.2 as llama.cpp keeps them (models/templates/meta-llama-*.jinja), Qwen3 (its
Qwen-Qwen3-0.6B.jinja: all the thinking Qwen3 models have that template), DeepSeek R1's
Llama 8B distill (the revision with <think> in the generation prompt), Mistral Nemo
(models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja) and Mistral 7B Instruct v0.3
(mistralai/Mistral-7B-Instruct-v0.3's tokenizer_config.json), Mistral Small 3.2 (llama.cpp's
models/templates copy), Phi-4 (microsoft/phi-4's, as llama.cpp's tests/test-chat-template.cpp
holds it) and Phi-4-mini (microsoft/Phi-4-mini-instruct's tokenizer_config.json value, as
several public sources quote it alike: guidance's chat templates, onnxruntime-genai's and the
Berkeley function-calling leaderboard's handlers). Jinja2 defines no strftime_now,
so Llama 3.2's template writes its fallback date, as quern does.

For Mistral v0.3 the lines also carry the token ids Mistral's own tokenizer (mistral_common,
MistralTokenizer.v3) gives the conversation, where it takes it (it refuses some that the
template renders), and the script writes tests/fixtures/mistral_v3_vocab.gguf: that tokenizer's
SentencePiece vocabulary as a GGUF (llama.cpp's token types), with the v0.3 template. For Mistral
Nemo they carry "tekken_ids": Nemo's own tokenizer's (MistralTokenizer from mistral_common's
tekken_240718.json), which the test checks over tests/fixtures/tekken_vocab.gguf.zst
(tools/ref_tokenizer_families.py writes it).

Without llama_cpp installed, Gemma's ids are taken from the fixture as it was (a line whose
text did not change keeps its ids).

Usage: python3 tools/ref_chat_templates.py [--gemma models/gemma-3-270m-q4_k_m.gguf]"""
import argparse
import datetime
import json
import os

import jinja2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n")

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}")

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

TPL_DIR = os.path.join("tests", "fixtures", "chat_templates")
FILES = {"llama31": "meta-llama-Llama-3.1-8B-Instruct.jinja",
         "llama32": "meta-llama-Llama-3.2-3B-Instruct.jinja",
         "mistral-v3": "mistralai-Mistral-7B-Instruct-v0.3.jinja",
         "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
         "qwen3": "Qwen-Qwen3-0.6B.jinja",
         "deepseek-r1": "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
         "mistral-v7": "mistralai-Mistral-Small-3.2-24B-Instruct-2506.jinja",
         "phi4": "microsoft-phi-4.jinja",
         "phi4-mini": "microsoft-Phi-4-mini-instruct.jinja"}

# name: (template, bos_token, eos_token)
TEMPLATES = {"gemma": (GEMMA3, "<bos>", "<eos>"), "llama3": (LLAMA3, "<|begin_of_text|>", ""),
             "llama2": (LLAMA2, "<s>", "</s>"), "mistral": (MISTRAL, "<s>", "</s>"),
             "phi3": (PHI3, "<s>", "<|endoftext|>"), "gemma2": (GEMMA2, "<bos>", "<eos>"),
             "llama31": (None, "<|begin_of_text|>", "<|eot_id|>"),
             "llama32": (None, "<|begin_of_text|>", "<|eot_id|>"),
             "mistral-v3": (None, "<s>", "</s>"), "mistral-nemo": (None, "<s>", "</s>"),
             "mistral-v7": (None, "<s>", "</s>"), "phi4": (None, "<|endoftext|>", "<|im_end|>"),
             "phi4-mini": (None, "<|endoftext|>", "<|endoftext|>"),
             "qwen3": (None, "", "<|im_end|>"),
             "deepseek-r1": (None, "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                             "<\uff5cend\u2581of\u2581sentence\uff5c>")}

U, A, S = "user", "assistant", "system"
CONVS = [
    [(U, "What is the capital of France?")],
    [(S, "You are terse."), (U, "Name a prime.")],
    [(U, "Hi"), (A, "Hello! How can I help?"), (U, "Tell me a joke.")],
    [(S, "Answer in French.\n"), (U, "  padded question\n\n"), (A, " Bonjour \t"), (U, "Encore")],
    [(U, "Line one\nLine two\n\tindented"), (A, "ok")],
    [(U, "\u3000wide space and emoji \U0001F600\u00a0")],
    [(U, "code:\n```c\nint x = 1;\n```")],
    [(S, "only a system prompt")],
    [(S, ""), (U, "empty system message")],
    [(S, "sys"), (U, "  \n ")],
    [(U, "a"), (S, "a system message in the middle"), (U, "b")],
    [(A, "an assistant turn first")],
]
# Mistral v0.3's system text goes into each user turn equal to the last one, Nemo's only into
# a last message that is a user turn
MISTRAL_CONVS = [
    [(S, "sys"), (U, "same"), (A, "x"), (U, "same")],
    [(S, "sys"), (U, "q"), (A, "answer")],
    [(S, "sys"), (U, "q"), (A, "a"), (S, "again")],
    [(S, "sys"), (U, "q"), (A, "a"), (A, "b")],
    [(S, "sys")],
]

# Mistral Small 3.2 writes a system message anywhere, counted as an assistant turn
V7_CONVS = [
    [(U, "hi"), (S, "mid"), (U, "q")],
    [(S, "s"), (U, "q"), (S, "note"), (U, "more")],
    [(S, "s"), (U, "q"), (A, "a"), (S, "note"), (U, "more")],
    [(U, "q"), (S, "x"), (A, "a")],
]

# the date Mistral Small 3.2's default system prompt writes (strftime_now("%Y-%m-%d")); the
# lines carry it as "today" and the test sets it
TODAY = "2026-12-07"

# Qwen3 writes the reasoning of an assistant turn after the last user query and strips it from
# the others; a user message wrapped in <tool_response> is not a query
QWEN3_CONVS = [
    [(U, "q"), (A, "<think>\nhm\n</think>\n\nanswer"), (U, "again")],
    [(U, "q"), (A, "<think>\nr1\n</think>\n\nans")],
    [(U, "q"), (A, "plain answer")],
    [(U, "q"), (A, "a1"), (U, "<tool_response>\nx\n</tool_response>"), (A, "<think>r</think>a2")],
    [(U, "q"), (A, "x</think>y</think>\n\nz"), (U, "<tool_response>t</tool_response>")],
    [(U, "q"), (A, "\n\n<think>\n\na<think>b\n\n</think>\n\nc"), (A, "d</think>")],
    [(S, "s"), (U, "q"), (S, "mid system"), (A, "\n\nlead")],
    [(A, "first </think>x")],
    [(U, "<tool_response>only</tool_response>"), (A, "<think>\n</think>a")],
]


def mistral_ids(msgs, tok=None):
    """Mistral's own token ids for msgs (tok: a MistralTokenizer, default v0.3's), or None where
    it refuses them."""
    from mistral_common.protocol.instruct.messages import (AssistantMessage, SystemMessage,
                                                          UserMessage)
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    cls = {S: SystemMessage, U: UserMessage, A: AssistantMessage}
    try:
        req = ChatCompletionRequest(messages=[cls[m["role"]](content=m["content"]) for m in msgs])
        return (tok or MistralTokenizer.v3()).encode_chat_completion(req).tokens
    except Exception:  # mistral_common's validation: not every conversation is taken
        return None


def spm_ids(text):
    """text's ids as Mistral's tokenizer writes a prompt: <s> [INST] [/INST] </s> as control
    tokens, each piece between them encoded alone (SentencePiece's prefix writing the space the
    template puts after [INST] and before an assistant turn). Only to check that Mistral's own
    ids are those of the template's text."""
    import re
    sp = spm()
    out = []
    for piece in re.split(r"(<s>|</s>|\[INST\]|\[/INST\])", text):
        if piece in ("<s>", "</s>", "[INST]", "[/INST]"):
            out.append(sp.piece_to_id(piece))
        elif piece:
            out += sp.encode(piece[1:] if piece.startswith(" ") else piece)
    return out


def tekken(version=None):
    """Mistral Nemo's tokenizer (tekken, v3 instruct) from mistral_common's data; version "v7":
    the same vocabulary with v7's instruct encoding (Mistral Small 3's: [SYSTEM_PROMPT] turns)."""
    import tempfile
    import mistral_common
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240718.json")
    if version:
        with open(path) as f:
            d = json.load(f)
        d["config"]["version"] = version
        path = os.path.join(tempfile.mkdtemp(), "tekken.json")  # (the name must say tekken)
        with open(path, "w") as f:
            json.dump(d, f)
    return MistralTokenizer.from_file(path)


def tekken_text_ids(text, tok):
    """text's ids as tekken writes a prompt: <s> [INST] [/INST] </s> as control tokens, each
    piece between them encoded alone (only to check that Mistral's ids are the template's)."""
    import re
    tk = tok.instruct_tokenizer.tokenizer
    out = []
    ctl = ("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
    for piece in re.split("(" + "|".join(re.escape(c) for c in ctl) + ")", text):
        if piece in ctl:
            out.append(tk.get_special_token(piece))
        elif piece:
            out += tk.encode(piece, bos=False, eos=False)
    return out


def spm():
    import glob
    import mistral_common
    import sentencepiece
    model = glob.glob(os.path.join(os.path.dirname(mistral_common.__file__), "data",
                                   "mistral_instruct_tokenizer_240323.model.v3"))[0]
    return sentencepiece.SentencePieceProcessor(model_file=model)


def mistral_vocab(out, template):
    """Mistral v0.3's SentencePiece vocabulary (from mistral_common) as a GGUF."""
    import gguf
    sp = spm()
    toks, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        toks.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 1)
    w = gguf.GGUFWriter(out, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemma", default=os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf"))
    a = ap.parse_args()
    try:
        from llama_cpp import Llama
        voc = Llama(model_path=a.gemma, vocab_only=True, verbose=False)
    except ImportError:
        voc = None
    tek, tek7 = tekken(), tekken("v7")
    out = os.path.join(ROOT, "tests", "fixtures", "chat_templates_ref.jsonl")
    old_ids = {}
    with open(out) as f:
        for line in f:
            r = json.loads(line)
            if "ids" in r:
                old_ids[r["text"]] = r["ids"]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # as transformers does
    env.globals["raise_exception"] = raise_exception
    n = 0
    with open(out, "w") as f:
        for name, (src, bos, eos) in TEMPLATES.items():
            if src is None:
                with open(os.path.join(ROOT, TPL_DIR, FILES[name])) as tf:
                    src = tf.read()
            tpl = env.from_string(src)
            extra = (MISTRAL_CONVS + V7_CONVS if name == "mistral-v7" else
                     MISTRAL_CONVS if name.startswith("mistral-") else
                     QWEN3_CONVS if name in ("qwen3", "deepseek-r1") else [])
            for conv in CONVS + extra:
                msgs = [{"role": r, "content": c} for r, c in conv]
                # Qwen3 also with chat_template_kwargs {"enable_thinking": false}
                kw = [{}, {"enable_thinking": False}] if name == "qwen3" else [{}]
                for agp, kwargs in [(a, k) for k in kw for a in (False, True)]:
                    rec = {"template": name}
                    if name in FILES:
                        rec["source_file"] = TPL_DIR + "/" + FILES[name]
                    else:
                        rec["source"] = src
                    rec.update({"messages": msgs, "add_generation_prompt": agp})
                    if name == "mistral-v7":  # (Llama 3.2's: no strftime_now, its fallback)
                        rec["today"] = TODAY
                        kwargs = dict(kwargs, strftime_now=lambda fmt: datetime.date.fromisoformat(
                            TODAY).strftime(fmt))
                    rec.update({k: v for k, v in kwargs.items() if k != "strftime_now"})
                    try:
                        rec["text"] = tpl.render(messages=msgs, add_generation_prompt=agp,
                                                 bos_token=bos, eos_token=eos, **kwargs)
                    except jinja2.exceptions.TemplateError as e:
                        rec["error"] = str(e)
                    if name == "gemma" and "text" in rec:
                        rec["ids"] = (voc.tokenize(rec["text"].encode(), add_bos=False,
                                                   special=True) if voc
                                      else old_ids[rec["text"]])
                    if name in ("mistral-nemo", "mistral-v7") and "text" in rec:
                        t = tek if name == "mistral-nemo" else tek7
                        ids = mistral_ids(msgs, t)
                        if ids is not None and ids == tekken_text_ids(rec["text"], t):
                            rec["tekken_ids"] = ids
                        else:
                            print("no tekken_ids: %r (%s)" % (
                                rec["text"], "refused" if ids is None else "another prompt"))
                    if name == "mistral-v3" and "text" in rec:
                        ids = mistral_ids(msgs)
                        if ids is not None and ids == spm_ids(rec["text"]):
                            rec["mistral_ids"] = ids
                        else:  # Mistral's tokenizer refuses it or builds another prompt
                            print("no mistral_ids: %r (%s)" % (
                                rec["text"], "refused" if ids is None else "another prompt"))
                    f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
                    n += 1
        # a conversation the Gemma template refuses: two user turns in a row
        msgs = [{"role": U, "content": "a"}, {"role": U, "content": "b"}]
        try:
            env.from_string(GEMMA3).render(messages=msgs, add_generation_prompt=True, bos_token="<bos>")
            raise SystemExit("expected the Gemma template to refuse")
        except jinja2.exceptions.TemplateError as e:
            f.write(json.dumps({"template": "gemma", "source": GEMMA3, "messages": msgs,
                                "add_generation_prompt": True, "error": str(e)},
                               separators=(",", ":")) + "\n")
            n += 1
    print("wrote %s: %d renderings" % (out, n))
    with open(os.path.join(ROOT, TPL_DIR, FILES["mistral-v3"])) as tf:
        mistral_vocab(os.path.join(ROOT, "tests", "fixtures", "mistral_v3_vocab.gguf"), tf.read())


if __name__ == "__main__":
    main()
