"""Built-in prompt sets for benchmarks and tests.

Speculation pays differently by task: input-grounded ones (edit, copy, answer from a given
document) reuse the prompt's own text, which n-gram lookup drafts well; open questions do not.
Long greedy outputs of small models also fall into loops, which inflate n-gram acceptance:
report the two sets apart.
"""

from __future__ import annotations

PARAGRAPH = (
    "The lighthouse stood on a rocky point at the edge of the bay. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick and polished the great lens, so that ships "
    "passing in the dark would know where the rocks were. In winter the storms were fierce, "
    "and waves broke over the lantern room more than once."
)

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
"""

GROUNDED = [
    f"Repeat this paragraph exactly:\n\n{PARAGRAPH}",
    f"Rewrite this paragraph in the present tense:\n\n{PARAGRAPH}",
    f"Fix any spelling mistakes in this text and return it:\n\n{PARAGRAPH.replace('the', 'teh', 3)}",
    f"Answer from the document. Document: {PARAGRAPH}\nQuestion: What did the keeper polish?",
    f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    f"Copy the first two sentences of this text:\n\n{PARAGRAPH}",
    f"Rename the variable `total` to `acc` in this code and return it:\n\n{CODE}",
    f"Answer from the document. Document: {PARAGRAPH}\nQuestion: When were the storms fierce?",
    f"Turn this paragraph into a bulleted list of facts:\n\n{PARAGRAPH}",
    f"Quote the last sentence of this paragraph:\n\n{PARAGRAPH}",
]

OPEN = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "Give me a tip for learning to code.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "What are the main differences between Python and JavaScript?",
    "How does the internet work?",
    "Tell me a fun fact about octopuses.",
    "Write a short story about a robot learning to paint.",
]

TASKS = {"grounded": GROUNDED, "open": OPEN}

# Prompts no built-in drafter training set contains (outrider/train/seed_prompts.py is checked
# against them in tests): where a drafter's accept length is measured.
HELDOUT = [
    "Describe how a bicycle gear system works.",
    "Write a short story about a robot who learns to paint.",
    "What are three ways to save water at home?",
    "Explain the difference between weather and climate.",
    "Give me a recipe for a simple tomato soup.",
    "Write a polite email declining a meeting invitation.",
    "What is the Pythagorean theorem? Give an example.",
    "List five animals that live in the Arctic.",
    "Write a Python function that counts the vowels in a string.",
    "Summarize the plot of Cinderella in three sentences.",
    "How do vaccines help the immune system?",
    "Suggest a weekend plan for a family with two kids.",
    "How do ocean tides work?",
    "Write a four-line poem about the moon.",
    "Explain what a noun is, with examples.",
    "What should I pack for a beach holiday?",
]
