"""A chat as the model reads it: the messages rendered with the tokenizer's own chat template, then tokenized.

One place for the server's chat endpoint, the bench's ``--chat`` prompts and ``train-draft``'s chat rows, so that
what the bench and a head's training see is exactly what the server gives the model.
"""

from typing import List, Sequence


def chat_token_ids(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> List[int]:
    """Token ids of ``messages`` (``{"role", "content"}`` dicts): transformers' ``apply_chat_template`` renders them
    as text (with the assistant's generation prompt where ``add_generation_prompt``), tokenized without the
    tokenizer's own special tokens, since the template writes its BOS itself (as vLLM's chat endpoint does).

    Raises:
        whatever the template raises: jinja's ``TemplateError`` for messages it refuses, transformers'
        ``ValueError`` for a tokenizer without a chat template.
    """
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids
