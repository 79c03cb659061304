#!/usr/bin/env python3
"""Seeds for fuzz_tokenizer's chat part (make fuzz): for each published chat template in
tests/fixtures/chat_templates_ref.jsonl, and a ChatML one, an input whose header picks a
SentencePiece or BPE tokenizer recognising the template from the GGUF (header byte 0: bits 1-3
= 5, byte 2: bit 2; so the pick is 13, past the named formats), a vocabulary with the formats' special tokens (type 3: control), the template, \\x01 and
three messages (first byte: role). Usage: chat_seeds.py OUT_DIR"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECIALS = ["<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<s>",
            "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>", "[INST]",
            "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "<|im_sep|>", "<think>", "</think>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
            "<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    sources = [CHATML]
    with open(os.path.join(ROOT, "tests", "fixtures", "chat_templates_ref.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "source_file" in rec:
                with open(os.path.join(ROOT, rec["source_file"])) as tf:
                    src = tf.read()
            else:
                src = rec["source"]
            if src not in sources:
                sources.append(src)
    vocab = b"".join(b"\x01" + c.encode() + b"\n" for c in "abcdefghij ")
    vocab += b"".join(b"\x03" + s.encode() + b"\n" for s in SPECIALS)
    msgs = (b"\x02You are terse.\n\x00What is 2+2?\n\x01<think>\nadd</think>\n\n Four. \n"
            b"\x00And 3+3?")
    for i, src in enumerate(sources):
        for spm in (0, 1):
            head = bytes([(5 << 1) | spm, 0, 1 | 4])
            with open(os.path.join(out, "chat%d_%d" % (i, spm)), "wb") as f:
                f.write(head + vocab + b"\n" + src.encode() + b"\x01" + msgs)


if __name__ == "__main__":
    main()
