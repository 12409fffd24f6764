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

# Prompts a drafter's accept length is measured on. Datagen given them as `exclude` drops
# every near-duplicate (datagen.near_duplicate) from the data: the built-in seed set holds a
# few (written before the check existed), and composed requests can make more.
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

# A second held-out set, written apart from every built-in prompt list (none of them in
# view), to check that a drafter does not only fit the phrasing of the first.
HELDOUT_FRESH = [
    "Write a Python function that checks whether a string is a valid IPv4 address.",
    "How do I reverse a singly linked list in Java? Please show the code.",
    "Can you write a SQL query to find the top three customers by total order value?",
    "Why does my JavaScript setTimeout inside a for loop with var always print 5?",
    "Write a bash script that renames all .jpeg files in a folder to .jpg.",
    "If a train travels 180 km in 2.5 hours, what is its average speed?",
    "I paid $84 for a jacket after a 30% discount. What was the original price?",
    "Quick one: what's 17% of 2,350?",
    "A recipe needs 3 eggs for 12 cookies. How many eggs do I need for 40 cookies?",
    "Write a short poem about the smell of rain on a city street.",
    "Could you write a heartfelt retirement message for a coworker who mentored me for ten years?",
    "Tell me a bedtime story about a shy dragon who learns to sing.",
    "haiku about morning coffee please",
    "I need a funny birthday card message for my brother who is turning 40.",
    "Write a 100-word story about a lighthouse keeper who finds a message in a bottle.",
    "How do noise-cancelling headphones actually work?",
    "What caused the fall of the Western Roman Empire?",
    "Explain inflation like I'm 12.",
    "How does caffeine affect sleep, and how late is too late for coffee?",
    "In simple terms, how does photosynthesis work?",
    "Why did the Berlin Wall fall in 1989?",
    "What does a router do, and how is it different from a modem?",
    "How do black holes form?",
    "Give me a 3-day itinerary for Lisbon on a moderate budget.",
    "What can I cook for dinner with chicken thighs, rice, and spinach?",
    "Any tips for staying focused while working from home?",
    "Make me a beginner 4-week running plan to build up to a 5K.",
    "How should I build an emergency fund on a $3,000 monthly income?",
    "Fix the grammar: Me and him goes to the store yesterday and buyed three apple.",
    "Translate into Spanish: Could you tell me where the nearest train station is?",
    "Rewrite this to sound more professional: hey just checking if u got my email about the "
    "invoice lol",
    "Summarize in one sentence: The council approved four new bus routes and later service "
    "hours after ridership rose and night workers complained.",
]
