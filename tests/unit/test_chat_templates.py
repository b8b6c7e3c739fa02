"""Chat templates: found where a model keeps one (specd.models.tokenizer.find_chat_template) and
rendered (specd.models.chat) as transformers renders them.

Each case copies the demo target's tokenizer files into a fresh directory and puts a distinct
template in each place a checkpoint may keep one: chat_template.jinja, chat_template.json,
tokenizer_config.json's chat_template as a string or as a list of named templates, and
several at once. The outside reference is transformers' own
`AutoTokenizer.from_pretrained(dir).apply_chat_template(...)` on the same directory.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specd.models.chat import chat_prompt_ids, render_chat
from specd.models.demo_paths import demo_model_dir
from specd.models.tokenizer import Tokenizer

SRC = demo_model_dir("target")
pytestmark = pytest.mark.skipif(not (SRC / "tokenizer.json").is_file(), reason="the bundled demo target is missing")

MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"}]

# Distinct templates, each with a marker naming where it lives. Multi-line ones exercise the
# trim_blocks / lstrip_blocks environment; CONFIG writes BOS itself, the others leave it to
# the tokenizer; DEFAULT closes turns with eos_token.
JINJA = """{%- for message in messages %}
    {%- if message['role'] == 'system' %}
<|im_start|>system [jinja]
{{ message['content'] }}<|im_end|>
    {%- else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
JSON = ("{% for m in messages %}[json] {{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[json] assistant:{% endif %}")
CONFIG = ("{{ bos_token }}{% for m in messages %}{% if loop.first and m.role != 'system' %}"
          "{{ raise_exception('system first') }}{% endif %}<|im_start|>{{ m.role }} [config]\n"
          "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT = ("{% for m in messages %}\n  {% if m.role == 'assistant' %}\n{{ m.content }}{{ eos_token }}\n"
           "  {% else %}\n[default] {{ m.role }}: {{ m.content }}\n  {% endif %}\n{% endfor %}\n"
           "{% if add_generation_prompt %}[default] assistant: {% endif %}")
TOOL_USE = "{% for m in messages %}[tool_use] {{ m.content }}\n{% endfor %}"
NAMED = [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]

# layout -> (files: where each template goes, the template expected to win)
LAYOUTS = {
    "jinja_file": ({"jinja": JINJA}, JINJA),
    "chat_template_json": ({"json": JSON}, JSON),
    "tokenizer_config_string": ({"config": CONFIG}, CONFIG),
    "tokenizer_config_named_list": ({"config": NAMED}, DEFAULT),
    # precedence, as transformers: a chat_template.jinja beats every other place
    "jinja_over_json_and_config": ({"jinja": JINJA, "json": JSON, "config": CONFIG}, JINJA),
    "jinja_over_named_list": ({"jinja": JINJA, "config": NAMED}, JINJA),
    # chat_template.json before tokenizer_config (transformers' processors read it; its
    # tokenizers never do, see _reference)
    "json_over_config": ({"json": JSON, "config": CONFIG}, JSON),
}


def make_model_dir(root: Path, files: dict) -> Path:
    """The demo target's tokenizer files, with its own chat template replaced by `files`."""
    d = root / "model"
    d.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(SRC / name, d / name)
    config = json.loads((SRC / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if "config" in files:
        config["chat_template"] = files["config"]
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if "jinja" in files:
        (d / "chat_template.jinja").write_text(files["jinja"])
    if "json" in files:
        (d / "chat_template.json").write_text(json.dumps({"chat_template": files["json"]}))
    return d


def _reference(d: Path, files: dict, messages: list[dict]) -> tuple[str, object]:
    """transformers' rendering of the directory, and its tokenizer."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(d)
    kwargs = {}
    if "json" in files and "jinja" not in files:
        # transformers' tokenizers do not read chat_template.json (a processor file); what
        # they load here is tokenizer_config's or nothing. So give them the file's template.
        assert hf.chat_template == files.get("config")
        kwargs["chat_template"] = json.loads((d / "chat_template.json").read_text())["chat_template"]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return text, hf


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_template_found_and_rendered_as_transformers(layout, tmp_path):
    files, expected = LAYOUTS[layout]
    d = make_model_dir(tmp_path, files)
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template == expected
    text = render_chat(tok, MESSAGES)
    ref_text, hf = _reference(d, files, MESSAGES)
    assert text == ref_text
    marker = {JINJA: "[jinja]", JSON: "[json]", CONFIG: "[config]", DEFAULT: "[default]"}[expected]
    assert marker in text and "[tool_use]" not in text
    # ids: a template that writes BOS is encoded without another; the others get the
    # tokenizer's BOS, as for any prompt
    writes_bos = ref_text.startswith(hf.bos_token)
    ref_ids = hf(ref_text, add_special_tokens=not writes_bos)["input_ids"]
    ids = chat_prompt_ids(tok, MESSAGES)
    assert ids == ref_ids
    assert ids.count(hf.bos_token_id) == 1 and ids[0] == hf.bos_token_id


def test_the_demo_targets_own_template_renders_as_transformers():
    tok = Tokenizer.from_dir(SRC)
    ref_text, _ = _reference(SRC, {}, MESSAGES)
    assert render_chat(tok, MESSAGES) == ref_text


def test_no_template_anywhere_is_a_clear_error(tmp_path):
    from specd.models.chat import ChatTemplateError

    tok = Tokenizer.from_dir(make_model_dir(tmp_path, {}))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_prompt_ids(tok, MESSAGES)


def test_template_errors_are_chat_template_errors(tmp_path):
    """raise_exception() in a template (CONFIG wants a system message first) surfaces as one error."""
    from specd.models.chat import ChatTemplateError

    tok = Tokenizer.from_dir(make_model_dir(tmp_path, {"config": CONFIG}))
    with pytest.raises(ChatTemplateError, match="system first"):
        render_chat(tok, MESSAGES[1:])


def test_tojson_renders_as_transformers(tmp_path):
    template = "{{ messages | tojson }}{% if add_generation_prompt %}\nassistant:{% endif %}"
    d = make_model_dir(tmp_path, {"jinja": template})
    messages = [{"role": "user", "content": "is a < b && 'c' > d? é"}]
    ref_text, _ = _reference(d, {"jinja": template}, messages)
    assert render_chat(Tokenizer.from_dir(d), messages) == ref_text


def test_generation_tag_and_pad_token_render_as_transformers(tmp_path):
    """{% generation %} blocks keep their body, and every special token reaches the template."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                "{% endgeneration %}{% else %}{{ m['content'] }}{{ pad_token }}{% endif %}{% endfor %}")
    d = make_model_dir(tmp_path, {"jinja": template})
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    from transformers import AutoTokenizer

    ours = render_chat(Tokenizer.from_dir(d), msgs)
    theirs = AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
