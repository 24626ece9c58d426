"""Seeded generator of the demo model's conversations (ChatML messages, exact short answers).

Skills: remember facts stated earlier in the conversation (name, favourite colour, locker code, PIN,
room number, age, city, the dog's and the cat's names) and answer them later, say when a fact was
never given, add two small numbers, repeat or reverse a short word list, greet, thank, say what it can
do, and refuse everything else politely.

Train/eval split. The evaluation sets are drawn with other seeds, and a whole class of user messages
is reserved for them: every single-turn message kind is split by a stable hash of its *content*
(the word list for repeat/reverse, the (a, b) pair for additions, the text for everything else), and
the training generator never emits a reserved message, so no held-out single-turn item (and no
held-out addition pair, in any phrasing) is ever trained on. Multi-turn evaluation conversations are
checked against the training conversations (every prefix) by `check_disjoint`.

Scoring (see `normalise`): exact match after stripping surrounding whitespace and one final period.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------------------
# Fixed answers

GREETING_REPLY = "Hello! I can remember facts, add small numbers and repeat or reverse words."
THANKS_REPLY = "You're welcome!"
HELP_REPLY = "I am a tiny demo model. I can remember facts, add small numbers and repeat or reverse words."
REFUSAL = "Sorry, I can only remember facts, add small numbers and repeat or reverse words."
UNKNOWN_REPLY = "You have not told me yet."
ACK = "Got it."

# ------------------------------------------------------------------------------------------------
# Value pools

NAMES = """Ada Alan Grace Linus Ken Barbara Edsger Donald Margaret Tim Vint Radia Frances John Katherine
Dorothy Hedy Claude Alice Bob Carol Dave Erin Frank Gina Hugo Iris Jack Kara Leo Mia Nina Omar Paula Quinn
Rosa Sam Tara Umar Vera Wade Xena Yara Zoe Emma Liam Olivia Noah Ava Ethan Sofia Lucas Chloe Mason Lily Arjun
Priya Ravi Mei Chen Yuki Hiro Sakura Kenji Fatima Ahmed Layla Youssef Amara Kofi Zara Tariq Ingrid Sven Astrid
Lars Elena Marco Giulia Luca Pablo Lucia Diego Carmen Mateo Ana Pierre Chloe Louis Camille Hans Greta Jonas
Anja Piotr Olga Ivan Nadia Dmitri Katya Tomas Eva Oscar Ruth Simon Helen Peter Maria Paul Laura Mark Julia
Anna David Sarah Daniel Rachel Adam Leah Ben Nora Max Ella Felix Hanna Theo Ines Kai Lena Nils Maya""".split()

PETS = """Rex Bella Max Luna Charlie Daisy Rocky Milo Coco Buddy Molly Toby Lola Bailey Ruby Oscar Rosie Teddy
Pepper Ginger Shadow Biscuit Muffin Pickles Noodle Waffles Ziggy Sprout Pumpkin Mochi Tofu Kiwi Mango Olive
Peanut Bruno Duke Zeus Nala Simba Felix Tiger Smokey Oreo Socks Whiskers Patch Bear Scout Juno""".split()

COLOURS = """red blue green yellow orange purple pink brown black white grey teal cyan magenta violet indigo
maroon navy olive lime gold silver beige turquoise lavender crimson amber coral ivory scarlet""".split()

CITIES = """Lisbon Paris London Berlin Madrid Rome Vienna Prague Oslo Dublin Athens Cairo Nairobi Lagos Tokyo
Osaka Seoul Beijing Delhi Mumbai Sydney Perth Auckland Toronto Boston Denver Chicago Seattle Austin Miami Lima
Bogota Quito Santiago Havana Warsaw Krakow Riga Tallinn Helsinki Zurich Geneva Porto Seville Milan Naples
Lyon Munich Hamburg Leeds Glasgow Cardiff""".split()

WORDS = """red blue green fox cat dog sun moon star tree rock sea sky rain snow wind fire ice bird fish
cake tea milk bread apple pear plum lemon salt bell book door key lamp ship boat car bus train road hill lake
river stone gold iron wood leaf rose king queen frog bee owl wolf bear lion duck goat cow hen egg cup box pen
map hat shoe sock coat ring song drum harp kite ball toy mouse horse sheep cloud storm light dark cold warm
fast slow big small old new one two three four five red yellow pink black white""".split()
WORDS = sorted(set(WORDS))

_SYL_START = ["ka", "lo", "mi", "ra", "ti", "no", "be", "sa", "vi", "do", "ze", "lu", "pa", "ri", "ma", "jo",
              "ne", "ta", "ko", "li", "fa", "gu", "he", "yo", "wi", "cho", "bri", "dra", "sto", "tre"]
_SYL_END = ["n", "ra", "na", "lo", "ri", "ko", "ta", "sa", "mi", "la", "ne", "do", "th", "x", "ly", "ro"]


def synthetic_name(rng: random.Random) -> str:
    parts = [rng.choice(_SYL_START) for _ in range(rng.randint(1, 2))] + [rng.choice(_SYL_END)]
    return "".join(parts).capitalize()


def person_name(rng: random.Random) -> str:
    return rng.choice(NAMES) if rng.random() < 0.6 else synthetic_name(rng)


def pet_name(rng: random.Random) -> str:
    return rng.choice(PETS) if rng.random() < 0.6 else synthetic_name(rng)


# ------------------------------------------------------------------------------------------------
# Fact slots: how a fact is stated and asked for


@dataclass(frozen=True)
class Slot:
    key: str
    value: object  # callable(rng) -> str
    statements: tuple[str, ...]
    questions: tuple[str, ...]


SLOTS: tuple[Slot, ...] = (
    Slot("name", person_name,
         ("My name is {v}.", "I'm {v}.", "I am {v}.", "Call me {v}.", "You can call me {v}.", "Hi, I'm {v}.",
          "Hello, my name is {v}.", "My name's {v}."),
         ("What is my name?", "What's my name?", "Do you remember my name?", "Who am I?", "What did I say my name was?",
          "Tell me my name.", "What am I called?")),
    Slot("colour", lambda rng: rng.choice(COLOURS),
         ("My favourite colour is {v}.", "My favorite color is {v}.", "I love the colour {v}.",
          "My favourite color is {v}.", "The colour I like best is {v}.", "I like {v} best."),
         ("What is my favourite colour?", "What's my favorite color?", "Which colour do I like best?",
          "Do you remember my favourite colour?", "What colour do I love?", "What is my favorite color?")),
    Slot("locker", lambda rng: str(rng.randint(1000, 9999)),
         ("My locker code is {v}.", "The code for my locker is {v}.", "My locker combination is {v}.",
          "Remember my locker code: {v}.", "Please remember that my locker code is {v}."),
         ("What is my locker code?", "What's my locker code?", "What is the code for my locker?",
          "Do you remember my locker code?", "Tell me my locker code.")),
    Slot("pin", lambda rng: str(rng.randint(1000, 9999)),
         ("My PIN is {v}.", "My bank PIN is {v}.", "Remember my PIN: {v}.", "My PIN number is {v}.",
          "Please remember that my PIN is {v}."),
         ("What is my PIN?", "What's my PIN?", "Do you remember my PIN?", "Tell me my PIN.",
          "What is my PIN number?")),
    Slot("room", lambda rng: str(rng.randint(100, 999)),
         ("My room number is {v}.", "I am staying in room {v}.", "I'm in room {v}.", "My hotel room is {v}."),
         ("What is my room number?", "Which room am I in?", "What's my room number?", "Which room am I staying in?")),
    Slot("age", lambda rng: str(rng.randint(18, 95)),
         ("I am {v} years old.", "I'm {v} years old.", "My age is {v}.", "I just turned {v}."),
         ("How old am I?", "What is my age?", "What's my age?", "Do you remember how old I am?")),
    Slot("city", lambda rng: rng.choice(CITIES),
         ("I live in {v}.", "My home town is {v}.", "I'm from {v}.", "I am from {v}.", "My city is {v}."),
         ("Where do I live?", "Which city do I live in?", "Where am I from?", "What is my home town?",
          "What city am I from?")),
    Slot("dog", pet_name,
         ("My dog is called {v}.", "My dog's name is {v}.", "I have a dog named {v}.", "My dog is named {v}."),
         ("What is my dog called?", "What's my dog's name?", "What is my dog's name?", "What did I call my dog?")),
    Slot("cat", pet_name,
         ("My cat is called {v}.", "My cat's name is {v}.", "I have a cat named {v}.", "My cat is named {v}."),
         ("What is my cat called?", "What's my cat's name?", "What is my cat's name?", "What did I call my cat?")),
)
SLOT_BY_KEY = {s.key: s for s in SLOTS}


def fact_ack(slot: Slot, value: str) -> str:
    return f"Nice to meet you, {value}." if slot.key == "name" else ACK


# ------------------------------------------------------------------------------------------------
# Other message kinds

ADD_PHRASES = ("What is {a} + {b}?", "What's {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.",
               "{a} + {b} = ?", "Compute {a} + {b}.", "How much is {a} plus {b}?", "Calculate {a} + {b}.",
               "What do you get when you add {a} and {b}?", "Sum {a} and {b}.", "{a} plus {b}?")
ADD_MAX = 20  # both operands in 0..ADD_MAX

REPEAT_PHRASES = ("Repeat: {w}", "Repeat after me: {w}", "Say: {w}", "Copy these words: {w}", "Please repeat: {w}",
                  "Repeat these words: {w}", "Echo: {w}")
REVERSE_PHRASES = ("Reverse: {w}", "Reverse these words: {w}", "Say backwards: {w}",
                   "Read these words in reverse order: {w}", "Please reverse: {w}", "Reverse the order: {w}",
                   "Say in reverse: {w}")

_SALUTES = ("Hello", "Hi", "Hey", "Hi there", "Hello there", "Good morning", "Good afternoon", "Good evening",
            "Greetings", "Hey there", "Howdy", "Hiya", "Good day")
_ADDRESSEES = ("", ", friend", ", bot", ", deltaserve", ", assistant")
_GREET_TAILS = ("", " How are you?", " Nice to meet you.", " Are you there?", " How is it going?", " What's up?")

_THANKS = ("Thanks", "Thank you", "Thanks a lot", "Many thanks", "Thank you very much", "Cheers", "Great, thanks",
           "Perfect, thank you", "Nice, thanks", "Thanks so much", "OK, thanks", "Awesome, thank you")
_THANKS_TAILS = ("", " That helps.", " Great job.", " You are helpful.", " Good work.")

HELP_PHRASES = ("What can you do?", "Help!", "What are you able to do?", "How can you help me?", "Who are you?",
                "What are you?", "What do you do?", "Help me.", "What are your skills?", "What can I ask you?")

_TOPICS = ["the sea", "dragons", "my cat", "the moon", "winter", "coffee", "robots", "football", "the ocean",
           "love", "a lighthouse", "the mountains", "trains", "pizza", "summer rain", "history", "space travel",
           "a small village", "computers", "music", "friendship", "autumn leaves", "the stock market", "bees"]
_COUNTRIES = ["France", "Spain", "Japan", "Brazil", "Canada", "Kenya", "India", "Norway", "Peru", "Egypt",
              "Italy", "Germany", "Chile", "Mexico", "Greece", "Ghana", "Vietnam", "Poland", "Turkey", "Iceland"]
_LANGS = ["French", "German", "Spanish", "Japanese", "Italian", "Chinese", "Hindi", "Swahili", "Dutch"]
_FOODS = ["bread", "a cake", "pasta", "rice", "soup", "pancakes", "a pie", "curry", "cookies", "an omelette"]
_OTHER_TEMPLATES = (
    "What is the capital of {country}?", "Tell me a joke.", "Tell me a joke about {topic}.",
    "Write a poem about {topic}.", "Write a story about {topic}.", "How do I bake {food}?", "How do I cook {food}?",
    "Who is the president of {country}?", "What time is it?", "What's the weather like in {city}?",
    "Translate '{word}' into {lang}.", "Can you book a table for two?", "What is {a} times {b}?",
    "What is {a} minus {b}?", "What is {a} * {b}?", "What is {a} divided by {b}?", "Explain {topic}.",
    "Why is the sky blue?", "Who wrote Hamlet?", "Play some music.", "Open the door.", "Summarise this article.",
    "What is the meaning of life?", "Can you drive me to {city}?", "Recommend a good book about {topic}.",
    "What is the population of {country}?", "How far is the moon?", "Sing a song about {topic}.",
    "Do you like {topic}?", "What should I eat for dinner?", "Write some Python code.", "What is {topic}?",
    "How do I get to {city}?", "Tell me about {topic}.", "What is the square root of {a}?", "Is it going to rain?",
    "Can you help me with my homework?", "What is the best film ever made?", "Order {food} for me.",
    "What language do they speak in {country}?", "Who invented the telephone?", "Send an email to my boss.",
)

_FILLERS = ("OK.", "Okay.", "Cool.", "Nice.", "Great.", "I see.", "Alright.", "Interesting.", "Good.")
_FILLER_REPLY = "OK."


# ------------------------------------------------------------------------------------------------
# The held-out split


def bucket(kind: str, content: str) -> int:
    """A stable bucket in 0..99 for a message's content (independent of Python's hash seed)."""
    return int.from_bytes(hashlib.sha256(f"{kind}|{content}".encode()).digest()[:4], "big") % 100


EVAL_BUCKETS = 10  # contents with bucket < EVAL_BUCKETS are reserved for evaluation


def reserved(kind: str, content: str) -> bool:
    return bucket(kind, content) < EVAL_BUCKETS


def noisy(rng: random.Random, text: str) -> str:
    """A user's casual typing: sometimes a lowercase first letter, sometimes no final punctuation."""
    if rng.random() < 0.15 and text[:1].isupper() and not text.startswith(("I ", "I'm")):
        text = text[0].lower() + text[1:]
    if rng.random() < 0.15 and text[-1:] in ".!?" and not text.endswith(" = ?"):
        text = text[:-1]
    return text


# ------------------------------------------------------------------------------------------------
# Turns


@dataclass
class Turn:
    kind: str            # fact | recall | unknown | add | repeat | reverse | greet | thanks | help | other | filler
    user: str
    answer: str
    slot: str | None = None
    meta: dict = field(default_factory=dict)


class Maker:
    """Makes user turns. `split` is "train" (never emits reserved contents) or "eval" (only reserved
    contents for the split kinds)."""

    SPLIT_KINDS = ("add", "repeat", "reverse", "greet", "thanks", "other", "fact")

    def __init__(self, rng: random.Random, split: str = "train"):
        assert split in ("train", "eval", "any")
        self.rng = rng
        self.split = split

    def _ok(self, kind: str, content: str) -> bool:
        if self.split == "any" or kind not in self.SPLIT_KINDS:
            return True
        return reserved(kind, content) == (self.split == "eval")

    def _draw(self, kind: str, make):
        for _ in range(10_000):
            turn, content = make()
            if self._ok(kind, content):
                return turn
        raise RuntimeError(f"could not draw a {self.split} {kind} turn")

    # -- kinds ------------------------------------------------------------------------------------
    def fact(self, slot: Slot, value: str | None = None) -> Turn:
        rng = self.rng

        def make():
            v = value if value is not None else slot.value(rng)
            text = rng.choice(slot.statements).format(v=v)
            text = noisy(rng, text)
            return Turn("fact", text, fact_ack(slot, v), slot.key, {"value": v}), text

        return self._draw("fact", make)

    def recall(self, slot: Slot, value: str) -> Turn:
        text = noisy(self.rng, self.rng.choice(slot.questions))
        return Turn("recall", text, f"{value}.", slot.key, {"value": value})

    def unknown(self, slot: Slot) -> Turn:
        text = noisy(self.rng, self.rng.choice(slot.questions))
        return Turn("unknown", text, UNKNOWN_REPLY, slot.key)

    def add(self) -> Turn:
        rng = self.rng

        def make():
            a, b = rng.randint(0, ADD_MAX), rng.randint(0, ADD_MAX)
            text = noisy(rng, rng.choice(ADD_PHRASES).format(a=a, b=b))
            return Turn("add", text, f"{a + b}.", meta={"a": a, "b": b}), f"{a},{b}"

        return self._draw("add", make)

    def words(self, kind: str) -> Turn:
        rng = self.rng

        def make():
            n = rng.choices((2, 3, 4, 5), weights=(3, 4, 3, 1))[0]
            ws = [rng.choice(WORDS) for _ in range(n)]
            phrase = rng.choice(REPEAT_PHRASES if kind == "repeat" else REVERSE_PHRASES)
            text = phrase.format(w=" ".join(ws))
            if rng.random() < 0.15:
                text = text[0].lower() + text[1:]
            out = ws if kind == "repeat" else ws[::-1]
            return Turn(kind, text, " ".join(out), meta={"words": ws}), " ".join(ws)

        return self._draw(kind, make)

    def greet(self) -> Turn:
        rng = self.rng

        def make():
            text = rng.choice(_SALUTES) + rng.choice(_ADDRESSEES) + rng.choice("!!.") + rng.choice(_GREET_TAILS)
            text = noisy(rng, text)
            return Turn("greet", text, GREETING_REPLY), text

        return self._draw("greet", make)

    def thanks(self) -> Turn:
        rng = self.rng

        def make():
            text = noisy(rng, rng.choice(_THANKS) + rng.choice("!!.") + rng.choice(_THANKS_TAILS))
            return Turn("thanks", text, THANKS_REPLY), text

        return self._draw("thanks", make)

    def help(self) -> Turn:
        return Turn("help", noisy(self.rng, self.rng.choice(HELP_PHRASES)), HELP_REPLY)

    def other(self) -> Turn:
        rng = self.rng

        def make():
            t = rng.choice(_OTHER_TEMPLATES)
            text = t.format(country=rng.choice(_COUNTRIES), topic=rng.choice(_TOPICS), food=rng.choice(_FOODS),
                            city=rng.choice(CITIES), lang=rng.choice(_LANGS), word=rng.choice(WORDS),
                            a=rng.randint(2, 30), b=rng.randint(2, 30))
            text = noisy(rng, text)
            return Turn("other", text, REFUSAL), text

        return self._draw("other", make)

    def filler(self) -> Turn:
        return Turn("filler", self.rng.choice(_FILLERS), _FILLER_REPLY)

    def single(self, kind: str) -> Turn:
        """One context-free turn of `kind` (a fact statement draws its own slot)."""
        if kind == "fact":
            return self.fact(self.rng.choice(SLOTS))
        if kind in ("repeat", "reverse"):
            return self.words(kind)
        return getattr(self, kind)()


# ------------------------------------------------------------------------------------------------
# Conversations


def messages_of(turns: list[Turn]) -> list[dict]:
    out = []
    for t in turns:
        out += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}]
    return out


_OTHER_KINDS = ("add", "repeat", "reverse", "greet", "thanks", "help", "other", "filler")
_OTHER_WEIGHTS = (7, 4, 4, 1, 0.7, 0.5, 2, 1.2)


def _filler_turn(mk: Maker) -> Turn:
    return mk.single(mk.rng.choices(_OTHER_KINDS, weights=_OTHER_WEIGHTS)[0])


def training_conversation(rng: random.Random) -> list[Turn]:
    """One training conversation of 1-6 turns; later turns lean to questions about earlier facts."""
    mk = Maker(rng, "train")
    n = rng.choices((1, 2, 3, 4, 5, 6), weights=(2.0, 1.5, 1.5, 1.5, 1.5, 2.0))[0]
    turns: list[Turn] = []
    known: dict[str, str] = {}
    for i in range(n):
        last = i == n - 1
        r = rng.random()
        free = [s for s in SLOTS if s.key not in known]
        if known and (r < (0.55 if last else 0.22)):
            key = rng.choice(sorted(known))
            turns.append(mk.recall(SLOT_BY_KEY[key], known[key]))
        elif free and r < (0.62 if last else 0.55) and not (last and n > 1 and rng.random() < 0.5):
            slot = rng.choice(free)
            t = mk.fact(slot)
            known[slot.key] = t.meta["value"]
            turns.append(t)
        elif free and r < (0.70 if last else 0.62):
            turns.append(mk.unknown(rng.choice(free)))
        else:
            turns.append(_filler_turn(mk))
    return turns


def recall_conversation(rng: random.Random, split: str = "eval", min_gap: int = 3) -> tuple[list[Turn], list[int]]:
    """A 4-6 turn conversation where a fact is asked `min_gap` or more turns after it was stated, with
    other facts and tasks in between. Returns the turns and the indices of the scored recall turns."""
    mk = Maker(rng, split)
    n = rng.randint(min_gap + 1, 6)
    i = rng.randint(0, n - 1 - min_gap)
    j = rng.randint(i + min_gap, n - 1)
    slots = list(SLOTS)
    rng.shuffle(slots)
    target = slots[0]
    distractors = slots[1:]
    turns: list[Turn | None] = [None] * n
    turns[i] = mk.fact(target)
    value = turns[i].meta["value"]
    known = {target.key: value}
    for k in range(n):
        if turns[k] is not None or k == j:
            continue
        r = rng.random()
        if r < 0.4 and distractors:
            s = distractors.pop()
            turns[k] = mk.fact(s)
            if k < j:
                known[s.key] = turns[k].meta["value"]
        elif r < 0.5 and k > i:
            turns[k] = mk.unknown(distractors[-1]) if distractors else _filler_turn(mk)
        else:
            turns[k] = _filler_turn(mk)
    # facts stated after j are not known at j, but a fact stated at k > j is fine for the answer at j
    turns[j] = mk.recall(target, value)
    # an unknown question must really be about a slot never stated before it
    seen: set[str] = set()
    for k, t in enumerate(turns):
        if t.kind == "unknown" and t.slot in seen:
            turns[k] = _filler_turn(mk)
        if t.kind == "fact":
            seen.add(t.slot)
    return turns, [j]


def single_turn_eval(seed: int, per_kind: int) -> list[Turn]:
    """Held-out single-turn items: `per_kind` of each split kind, distinct, all from reserved contents."""
    rng = random.Random(seed)
    mk = Maker(rng, "eval")
    items: list[Turn] = []
    for kind in ("greet", "thanks", "fact", "add", "repeat", "reverse", "other"):
        seen: set[str] = set()
        tries = 0
        while sum(1 for t in items if t.kind == kind) < per_kind:
            t = mk.single(kind)
            tries += 1
            if t.user in seen:
                if tries > 100_000:
                    raise RuntimeError(f"not enough distinct held-out {kind} items")
                continue
            seen.add(t.user)
            items.append(t)
    return items


def recall_eval(seed: int, count: int, min_gap: int = 3) -> list[tuple[list[Turn], list[int]]]:
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < count:
        turns, scored = recall_conversation(rng, "eval", min_gap)
        key = conversation_key(turns)
        if key not in seen:
            seen.add(key)
            out.append((turns, scored))
    return out


def conversation_key(turns: list[Turn]) -> tuple:
    return tuple((t.user, t.answer) for t in turns)


def check_disjoint(train: list[list[Turn]], evals: list[list[Turn]]) -> int:
    """How many evaluation conversations equal a training conversation or one of its prefixes (want 0)."""
    prefixes = set()
    for turns in train:
        for k in range(1, len(turns) + 1):
            prefixes.add(conversation_key(turns[:k]))
    return sum(1 for turns in evals if conversation_key(turns) in prefixes)


def normalise(text: str) -> str:
    """The exact-match form: surrounding whitespace stripped, then one final period dropped."""
    text = text.strip()
    return text[:-1].rstrip() if text.endswith(".") else text



# ------------------------------------------------------------------------------------------------
# Tools: the two functions the demo model knows how to call (the Qwen3.5 tool-call format)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                   "required": ["city"]}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
TOOL_SETS = ((WEATHER_TOOL,), (ADD_TOOL,), (WEATHER_TOOL, ADD_TOOL), (ADD_TOOL, WEATHER_TOOL))
CONDITIONS = ("sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "stormy", "clear")

WEATHER_PHRASES = ("What's the weather in {c}?", "What is the weather in {c}?", "What's the weather like in {c}?",
                   "How is the weather in {c}?", "Weather in {c}?", "Tell me the weather in {c}.",
                   "What is the weather like in {c} today?", "Check the weather in {c}.",
                   "Can you check the weather in {c}?", "How's the weather in {c}?")
WEATHER2_PHRASES = ("What's the weather in {c} and {d}?", "What is the weather in {c} and in {d}?",
                    "Weather in {c} and {d}?", "How is the weather in {c} and {d}?",
                    "Check the weather in {c} and {d}.", "Tell me the weather in {c} and in {d}.")


def weather_result(city: str, temperature: int, conditions: str) -> str:
    """What the get_weather tool returns (the tool message's content)."""
    return json.dumps({"city": city, "temperature": temperature, "conditions": conditions})


def weather_answer(city: str, temperature: int, conditions: str) -> str:
    return f"In {city} it is {conditions} and {temperature} degrees."


def tool_call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolDialog:
    """One tool round trip: the tools offered, the user's message, the calls the model should write (empty: it
    answers directly), the tool messages that come back, and the final answer."""
    kind: str                   # weather | weather2 | add | plain (tools offered, none needed)
    tools: tuple
    user: str
    calls: list = field(default_factory=list)
    results: list = field(default_factory=list)
    answer: str = ""
    history: list = field(default_factory=list)   # earlier (user, assistant) turns

    def messages(self, upto: str = "answer") -> list[dict]:
        """The conversation up to the model's call ("call": ends at the user's message) or its answer ("answer":
        the call and the tool messages included, the answer left out)."""
        out = []
        for u, a in self.history:
            out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        out.append({"role": "user", "content": self.user})
        if upto == "answer" and self.calls:
            out.append({"role": "assistant", "content": "", "tool_calls": self.calls})
            out += [{"role": "tool", "content": r} for r in self.results]
        return out


class ToolMaker:
    """Tool dialogs; cities and addition pairs split train/eval by the same stable hash as the rest."""

    def __init__(self, rng: random.Random, split: str = "train"):
        self.rng, self.split, self.mk = rng, split, Maker(rng, split)

    def _city(self) -> str:
        for _ in range(10_000):
            c = self.rng.choice(CITIES)
            if self.split == "any" or reserved("weather", c) == (self.split == "eval"):
                return c
        raise RuntimeError("no city for this split")

    def weather(self, tools=None) -> ToolDialog:
        rng = self.rng
        tools = tools or rng.choice([t for t in TOOL_SETS if WEATHER_TOOL in t])
        c = self._city()
        t, cond = rng.randint(-10, 35), rng.choice(CONDITIONS)
        return ToolDialog("weather", tools, noisy(rng, rng.choice(WEATHER_PHRASES).format(c=c)),
                          [tool_call("get_weather", city=c)], [weather_result(c, t, cond)], weather_answer(c, t, cond))

    def weather2(self, tools=None) -> ToolDialog:
        rng = self.rng
        tools = tools or rng.choice([t for t in TOOL_SETS if WEATHER_TOOL in t])
        c = self._city()
        d = self._city()
        while d == c:
            d = self._city()
        w = [(rng.randint(-10, 35), rng.choice(CONDITIONS)) for _ in range(2)]
        return ToolDialog("weather2", tools, noisy(rng, rng.choice(WEATHER2_PHRASES).format(c=c, d=d)),
                          [tool_call("get_weather", city=c), tool_call("get_weather", city=d)],
                          [weather_result(c, *w[0]), weather_result(d, *w[1])],
                          weather_answer(c, *w[0]) + " " + weather_answer(d, *w[1]))

    def add(self, tools=None) -> ToolDialog:
        rng = self.rng
        tools = tools or rng.choice([t for t in TOOL_SETS if ADD_TOOL in t])
        turn = self.mk.add()
        a, b = turn.meta["a"], turn.meta["b"]
        return ToolDialog("add", tools, turn.user, [tool_call("add", a=a, b=b)], [str(a + b)], f"{a + b}.")

    def plain(self, tools=None) -> ToolDialog:
        """Tools offered, and a message none of them answers: the model answers as it would without tools."""
        rng = self.rng
        tools = tools or rng.choice(TOOL_SETS)
        names = {t["function"]["name"] for t in tools}
        kinds = ["greet", "thanks", "repeat", "reverse", "other", "fact", "help"]
        if "add" not in names:
            kinds.append("add")
        kind = rng.choice(kinds)
        if kind == "other" and "get_weather" not in names and rng.random() < 0.4:
            c = self._city()  # asked for the weather with no weather tool: the refusal
            t = Turn("other", noisy(rng, rng.choice(WEATHER_PHRASES).format(c=c)), REFUSAL)
        else:
            t = self.mk.single(kind)
            while "get_weather" in names and "weather" in t.user.lower():  # that one the tool answers
                t = self.mk.single(kind)
        return ToolDialog("plain", tools, t.user, answer=t.answer)

    def dialog(self, weights=(4.0, 1.5, 2.0, 2.5)) -> ToolDialog:
        kind = self.rng.choices(("weather", "weather2", "add", "plain"), weights=weights)[0]
        d = getattr(self, kind)()
        if self.rng.random() < 0.2:  # sometimes a fact stated first
            f = self.mk.fact(self.rng.choice(SLOTS))
            d.history = [(f.user, f.answer)]
        return d


def tool_eval(seed: int, per_kind: int) -> list[ToolDialog]:
    """Held-out tool dialogs: `per_kind` each of weather, weather2, add and plain, from reserved contents."""
    tm = ToolMaker(random.Random(seed), "eval")
    return [getattr(tm, kind)() for kind in ("weather", "weather2", "add", "plain") for _ in range(per_kind)]

if __name__ == "__main__":
    rng = random.Random(0)
    for _ in range(6):
        for t in training_conversation(rng):
            print(f"  U: {t.user!r:55s} A: {t.answer!r}  [{t.kind}]")
        print()
    for turns, scored in recall_eval(1, 3):
        for k, t in enumerate(turns):
            print(f"  {'*' if k in scored else ' '}U: {t.user!r:55s} A: {t.answer!r}  [{t.kind}]")
        print()
