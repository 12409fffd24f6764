"""Composed user requests: templates of the requests people send a chat model ("Explain
{concept} to {audience}.", "Write a {form} about {subject}.") filled from lists of topics, so
drafter data can hold tens of thousands of distinct, natural one-line requests without an
external dataset. The handwritten seed set (seed_prompts.py) is 152 requests and Magpie turns
are what the target imagines users ask; composed requests sit between: the phrasing of real
requests, spread over many subjects.

`compose_prompts(n, seed)` is deterministic: the same (n, seed) gives the same list, and a
longer list starts with the shorter one.
"""

from __future__ import annotations

import random
import re

_SLOTS: dict[str, tuple[str, ...]] = {
    "concept": (
        "photosynthesis", "gravity", "inflation", "the water cycle", "black holes", "evolution",
        "supply and demand", "compound interest", "machine learning", "plate tectonics",
        "the greenhouse effect", "democracy", "electricity", "magnetism", "DNA",
        "the stock market", "blockchain", "recycling", "the internet", "climate change",
        "the French Revolution", "the Renaissance", "the Roman Empire", "the solar system",
        "rainbows", "earthquakes", "volcanoes", "nuclear energy", "solar power", "wind turbines",
        "the human heart", "sleep", "memory", "habits", "time zones", "taxes", "credit scores",
        "encryption", "cloud computing", "operating systems", "search engines", "antibiotics",
        "the placebo effect", "inertia", "friction", "sound waves", "light", "atoms",
        "chemical reactions", "fermentation", "the printing press", "the industrial revolution",
        "photosynthesis in the ocean", "bird migration", "hibernation", "the food chain",
        "erosion", "hurricanes", "the seasons", "leap years", "prime numbers", "probability",
        "fractions", "percentages", "statistics", "algorithms", "recursion",
        "object-oriented programming", "databases", "version control", "neural networks",
        "renewable energy", "the electoral college", "globalization", "opportunity cost",
        "minimalism", "meditation", "mindfulness",
    ),
    "pair": (
        "a virus and a bacterium", "speed and velocity", "a simile and a metaphor",
        "stocks and bonds", "RAM and storage", "an atom and a molecule",
        "a democracy and a republic", "baking soda and baking powder",
        "a crocodile and an alligator", "empathy and sympathy", "a lake and a pond",
        "mass and weight", "a star and a planet", "a debit card and a credit card",
        "HTTP and HTTPS", "Python and JavaScript", "a comet and an asteroid", "a frog and a toad",
        "a hurricane and a tornado", "revenue and profit", "fiction and nonfiction",
        "a loan and a lease", "coffee and espresso", "a violin and a viola",
        "a college and a university", "a compiler and an interpreter", "a list and a dictionary",
        "AC and DC current", "an ocean and a sea", "a hill and a mountain", "jam and jelly",
        "a rabbit and a hare", "affect and effect", "a cold and the flu", "an app and a website",
        "wool and cotton",
    ),
    "thing": (
        "a refrigerator", "a microwave oven", "a camera", "a telescope", "a compass",
        "a smartphone", "a car engine", "an airplane", "a submarine", "a thermometer", "a battery",
        "a light bulb", "a washing machine", "a clock", "a piano", "an elevator", "a helicopter",
        "a printer", "a solar panel", "a vacuum cleaner", "a lock and key", "a parachute",
        "a hot air balloon", "a zipper", "a toaster", "a GPS receiver", "a wind turbine",
        "a touchscreen", "a credit card", "a water filter", "an electric guitar",
    ),
    "animal": (
        "dolphins", "elephants", "octopuses", "bees", "penguins", "wolves", "owls", "cats", "dogs",
        "sharks", "butterflies", "ants", "whales", "eagles", "frogs", "horses", "koalas",
        "chameleons", "bats", "camels", "polar bears", "parrots", "salmon", "spiders", "turtles",
    ),
    "place": (
        "Japan", "Italy", "Brazil", "Egypt", "Canada", "Iceland", "Kenya", "Mexico", "India",
        "Norway", "Peru", "Australia", "Morocco", "Vietnam", "Greece", "Scotland", "Portugal",
        "New Zealand", "Thailand", "Chile", "Paris", "Tokyo", "New York", "Rome", "Barcelona",
        "London", "Istanbul", "the Alps", "the Sahara", "the Amazon rainforest",
    ),
    "food": (
        "pancakes", "banana bread", "vegetable curry", "guacamole", "fried rice",
        "chocolate chip cookies", "a Greek salad", "spaghetti carbonara", "hummus", "omelette",
        "a fruit smoothie", "pizza dough", "apple pie", "tacos", "mashed potatoes",
        "a vegetable stir-fry", "oatmeal", "a quiche", "lemonade", "French toast",
        "a chickpea salad", "roasted vegetables", "muffins",
    ),
    "audience": (
        "a five-year-old", "a ten-year-old", "a teenager", "a beginner", "my grandmother",
        "a high school student", "someone who has never heard of it", "a busy manager",
        "a college student", "a non-native English speaker",
    ),
    "form": (
        "story", "poem", "haiku", "limerick", "song chorus", "fable", "diary entry", "dialogue",
        "children's story", "sonnet", "news headline and first paragraph", "riddle", "speech",
        "tweet",
    ),
    "subject": (
        "a lost cat finding its way home", "the first day of spring", "a lighthouse keeper",
        "a dragon who is afraid of the dark", "friendship", "a rainy afternoon", "the ocean",
        "a city at night", "an old tree", "a time traveler", "a girl who can talk to birds",
        "autumn leaves", "a snowman", "the stars", "a small bakery", "a brave little mouse",
        "a forgotten toy", "a long train journey", "the last day of school", "a garden",
        "a mountain climber", "coffee", "a thunderstorm", "a knight and a wizard",
        "a message in a bottle", "a family dinner", "a detective solving a mystery",
        "a dog's first snow", "a kind stranger", "the sea",
    ),
    "occasion": (
        "a birthday", "a wedding", "a retirement party", "a graduation", "a new baby",
        "a job promotion", "a farewell at work", "Mother's Day", "a housewarming",
        "an anniversary", "New Year's Eve", "a thank-you to a teacher",
    ),
    "email": (
        "asking my manager for a day off", "following up after an interview",
        "apologizing for a late reply", "requesting a refund", "inviting a colleague to lunch",
        "asking a professor for an extension", "thanking a client", "rescheduling a meeting",
        "complaining about a noisy neighbor", "introducing myself to a new team",
        "asking for a recommendation letter", "welcoming a new employee",
        "reminding a friend about money they owe me", "cancelling a subscription",
    ),
    "count": (
        "three", "four", "five", "six", "seven", "ten",
    ),
    "things": (
        "fruits that are high in vitamin C", "ways to reduce stress", "books for teenagers",
        "tips for learning a new language", "healthy breakfast ideas", "board games for families",
        "ways to save money on groceries", "careers in science", "famous inventors",
        "ways to be more productive", "indoor plants that are easy to care for",
        "tips for a job interview", "exercises you can do at home", "hobbies for retirees",
        "ways to make a small room feel bigger", "questions to ask on a first date",
        "facts about the human brain", "rainy day activities for kids", "uses for baking soda",
        "tips for better sleep", "ways to reduce plastic waste", "classic movies",
        "vegetables that grow well in pots", "ideas for a science fair project",
        "ways to stay motivated", "programming languages for beginners", "mammals that lay eggs",
        "tips for public speaking", "things to do on a rainy weekend",
    ),
    "skill": (
        "learn to play the guitar", "start running", "improve my handwriting", "learn to cook",
        "become a better listener", "learn to code", "start a vegetable garden", "write a resume",
        "learn to swim as an adult", "improve my memory", "start journaling", "learn chess",
        "make friends in a new city", "train a puppy", "prepare for a marathon", "learn to draw",
        "save for a house", "speak more confidently", "organize my closet", "study for exams",
    ),
    "code_task": (
        "checks whether a number is prime", "reverses a string", "counts the words in a sentence",
        "finds the largest number in a list", "computes the factorial of a number",
        "removes duplicates from a list", "converts Celsius to Fahrenheit",
        "checks whether two strings are anagrams", "returns the Fibonacci numbers up to n",
        "sorts a list of names alphabetically", "merges two sorted lists",
        "validates a phone number", "flattens a nested list",
        "computes the average of a list of numbers", "finds the second smallest element of a list",
        "capitalizes every word in a sentence", "checks whether a year is a leap year",
        "returns the sum of the digits of a number",
        "reads a text file and prints its longest line",
    ),
    "lang": (
        "Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "TypeScript",
    ),
    "person": (
        "Albert Einstein", "Marie Curie", "Leonardo da Vinci", "Cleopatra", "Isaac Newton",
        "Ada Lovelace", "Nelson Mandela", "William Shakespeare", "Frida Kahlo", "Galileo",
        "Charles Darwin", "Mahatma Gandhi", "Amelia Earhart", "Nikola Tesla", "Jane Austen",
        "Mozart", "Abraham Lincoln", "Rosa Parks", "Confucius", "Alan Turing",
    ),
    "story": (
        "Romeo and Juliet", "The Little Prince", "Snow White", "Hamlet", "The Odyssey",
        "Little Red Riding Hood", "The Three Little Pigs", "Peter Pan", "Alice in Wonderland",
        "The Tortoise and the Hare", "Robin Hood", "Moby-Dick", "Pride and Prejudice",
        "Hansel and Gretel", "Treasure Island", "The Wizard of Oz",
    ),
    "situation": (
        "a student on a budget", "a couple's anniversary", "a rainy weekend",
        "a first trip abroad", "a day with no internet", "a visit from my parents",
        "a team-building day", "a birthday party for a seven-year-old", "a solo trip",
    ),
    "trip": (
        "a camping trip", "a ski trip", "a business trip", "a week in a city", "a hiking weekend",
        "a long flight", "a road trip", "a winter holiday in the mountains",
    ),
    "sentence": (
        "The meeting is moved to Friday because the manager is sick.",
        "We regret to inform you that your application was not successful.",
        "Our new app helps you track your spending and save money every month.",
        "The weather was bad so we stayed at home and watched movies all day.",
        "Please make sure all the reports are sent before the end of the day.",
        "The cat sat on the windowsill and watched the birds in the garden.",
        "Our store will be closed on Monday for the public holiday.",
        "I think we should start the project earlier so we have time to test it.",
        "The train was late again and I missed the start of the concert.",
        "Scientists have found a new species of frog in the rainforest.",
        "Thank you for your order, it will arrive in three to five working days.",
        "The museum is free on Sundays and has a new exhibition about dinosaurs.",
        "He forgot his keys, so he had to wait outside until his sister came home.",
        "Regular exercise improves both physical health and mood.",
        "The company reported higher profits this year thanks to strong online sales.",
        "Remember to water the plants while I am away on holiday.",
    ),
    "style": (
        "more formal", "more friendly", "simpler", "more polite", "more concise", "more exciting",
        "more professional", "easier for a child to understand",
    ),
    "target_lang": (
        "French", "Spanish", "German", "Italian", "Portuguese", "Dutch",
    ),
    "math": (
        "What is 15% of 240?", "Solve for x: 3x + 7 = 22.",
        "What is the area of a circle with radius 5?",
        "A train travels 180 km in 2 hours. What is its average speed?",
        "Simplify the fraction 18/24.", "What is the square root of 144?",
        "If I save $50 a week, how much will I have after a year?",
        "What is the perimeter of a rectangle that is 8 cm long and 3 cm wide?",
        "Convert 5 kilometers to miles.", "What is 7 factorial?",
        "Solve the system: x + y = 10 and x - y = 4.",
        "What is the sum of the angles in a triangle?",
        "A shirt costs $40 and is 25% off. What is the sale price?",
        "What is the probability of rolling two sixes with two dice?",
        "How many minutes are there in a week?", "What is the next prime number after 31?",
        "Find the mean of 4, 8, 15, 16, 23 and 42.", "What is 2 to the power of 10?",
        "Solve x^2 - 5x + 6 = 0.", "How many seconds are there in 3 hours?",
    ),
}  # fmt: skip

_TEMPLATES: tuple[str, ...] = (
    # explaining
    "Explain {concept} in simple terms.", "Explain {concept} to {audience}.",
    "Tell me about {concept}.", "How does {concept} work?", "Why should I care about {concept}?",
    "Give me a short explanation of {concept}.", "What are the main ideas behind {concept}?",
    "Describe {concept} in three sentences.", "What are common misconceptions about {concept}?",
    "Explain the difference between {pair}.", "What is the difference between {pair}?",
    "How does {thing} work?", "Describe how {thing} works.", "Who invented {thing}?",
    "Explain how {thing} works to {audience}.",
    "Tell me some interesting facts about {animal}.", "How do {animal} communicate?",
    "Where do {animal} live, and what do they eat?", "Why are {animal} important to their ecosystem?",
    "Who was {person}?", "What is {person} famous for?", "Summarize the life of {person}.",
    "What can we learn from {person}?",
    # writing
    "Write a {form} about {subject}.", "Write a short {form} about {subject}.",
    "Write a {form} about {animal}.", "Write a {form} about {place}.",
    "Write a {form} for {occasion}.", "Write a card message for {occasion}.",
    "Write a short toast for {occasion}.", "Write an email {email}.",
    "Write a polite email {email}.", "Write a short, friendly email {email}.",
    "Write a product description for {thing}.", "Write an advertisement for {thing}.",
    "Write a short review of a restaurant that serves {food}.",
    # code
    "Write a {lang} function that {code_task}.", "Write a {lang} program that {code_task}.",
    "How do I write a function in {lang} that {code_task}?",
    "Show me {lang} code that {code_task}, with comments.",
    # math
    "{math}", "{math} Show your steps.", "{math} Explain your answer.",
    # lists and advice
    "List {count} {things}.", "Give me {count} {things}.", "What are {count} {things}?",
    "Suggest {count} {things}.", "Name {count} {things} and explain each briefly.",
    "How can I {skill}?", "Give me tips to {skill}.", "What is the best way to {skill}?",
    "Make a one-week plan to {skill}.", "I want to {skill}. Where should I start?",
    "Suggest a plan for {situation}.", "Give me ideas for {situation}.",
    "What should I pack for {trip}?", "Make a packing list for {trip}.",
    "Give me a recipe for {food}.", "How do I make {food}?",
    "What ingredients do I need for {food}?", "Give me a simple recipe for {food} for two people.",
    "Plan a three-day trip to {place}.", "What should I see in {place}?",
    "What is the food like in {place}?", "Tell me about the history of {place}.",
    "What is the best time of year to visit {place}?",
    # stories and text
    "Summarize the plot of {story} in three sentences.", "Summarize {story} for {audience}.",
    "Who are the main characters in {story}?", "What is the moral of {story}?",
    "Retell {story} from the villain's point of view.",
    "Rewrite this sentence to be {style}: {sentence}", "Make this {style}: {sentence}",
    "Translate to {target_lang}: {sentence}", "Summarize in a few words: {sentence}",
    "Fix the grammar and improve the wording: {sentence}",
    "Turn this into a question: {sentence}",
)  # fmt: skip

_SLOT = re.compile(r"\{(\w+)\}")


def compose_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct requests, or every request the templates can make if that is fewer (about
    COMPOSED_CAPACITY). Templates take turns, in an order shuffled each round, each drawing its
    next slot filling from its own shuffled list: no template crowds out the others until the
    smaller ones are used up."""
    if n < 0:
        raise ValueError(f"n={n!r}: use a count >= 0")
    rng = random.Random(seed)
    pools = [_fillings(t, rng) for t in _TEMPLATES]
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n and pools:
        rng.shuffle(pools)
        for pool in pools:
            while pool:
                text = pool.pop()
                if text not in seen:
                    seen.add(text)
                    out.append(text)
                    break
            if len(out) == n:
                break
        pools = [p for p in pools if p]
    return out


def _fillings(template: str, rng: random.Random) -> list[str]:
    """Every filling of template's slots, shuffled (popped from the end)."""
    texts = [""]
    pos = 0
    for m in _SLOT.finditer(template):
        lead = template[pos : m.start()]
        texts = [t + lead + v for t in texts for v in _SLOTS[m.group(1)]]
        pos = m.end()
    texts = [t + template[pos:] for t in texts]
    texts = [t[0].upper() + t[1:] for t in texts]
    rng.shuffle(texts)
    return texts


COMPOSED_CAPACITY = len(set().union(*(_fillings(t, random.Random(0)) for t in _TEMPLATES)))
