"""Chat templates written for the tests that render what the public Qwen3 (tokenizer_config.json)
and Qwen3.5 / 3.6 (chat_template.jinja) templates render for the parts the server parses: the tool
list in the system turn, an assistant's tool calls (Qwen3: hermes JSON; Qwen3.5: qwen3_coder XML),
tool results (consecutive `tool` messages in one user turn of `<tool_response>` blocks), an earlier
turn's reasoning and the generation prompt (Qwen3: plain, `enable_thinking: false` adds an empty
think block; Qwen3.5: opens `<think>`). `tests/test_chat_parsers.py` checks the rendered strings
against the public formats, and the parsers against what the templates render."""

_TOOL_RESPONSES = (
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
)

_TURNS = (
    "{%- set first = 1 if (tools and messages[0].role == 'system') else 0 %}"
    "{%- for m in messages %}"
    "{%- if loop.index0 < first %}"
    "{%- elif m.role in ('system', 'user') %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}"
    "{{- '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "CALL"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}" + _TOOL_RESPONSES + "{%- endif %}"
    "{%- endfor %}"
)

QWEN3 = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    + _TURNS.replace(
        "CALL",
        '{{- \'<tool_call>\\n{\\"name\\": \\"\' + c.function.name + \'\\", \\"arguments\\": \''
        " + (c.function.arguments | tojson) + '}\\n</tool_call>' }}",
    )
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

QWEN35 = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n"
    "<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format "
    "with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
    "{%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    + _TURNS.replace(
        "CALL",
        "{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
        "{%- for k, v in c.function.arguments | items %}"
        "{{- '<parameter=' + k + '>\\n' + (v if v is string else (v | tojson)) + "
        "'\\n</parameter>\\n' }}"
        "{%- endfor %}{{- '</function>\\n</tool_call>' }}",
    )
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
