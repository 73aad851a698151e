"""Write the example conversations: chats.jsonl (training) and chats-eval.jsonl (held out).

An assistant that names capital cities, in four phrasings, with follow-up questions and, in a
few rows, a system message asking for short answers. Every row is ``{"messages": [...]}``, the
format ``flowtrain train --data`` reads for chat fine-tuning. Each held-out row opens with a
(country, phrasing) pair that no training row uses, so the held-out loss measures whether the
model learnt the facts rather than the rows.

    python docs/examples/make_chats.py docs/examples      # the files in the repository

Deterministic: the same files on every run (a fixed seed, no clock).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("Canada", "Ottawa"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Cuba", "Havana"), ("India", "New Delhi"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Mexico", "Mexico City"), ("Australia", "Canberra"),
]
QUESTIONS = [
    "What is the capital of {country}?",
    "Which city is the capital of {country}?",
    "Tell me the capital of {country}.",
    "{country}: what is its capital?",
]
SHORT = "Answer as briefly as you can."


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def answer(country: str, city: str) -> str:
    return f"The capital of {country} is {city}."


def single(country: str, city: str, q: int) -> list[dict]:
    return [turn("user", QUESTIONS[q].format(country=country)), turn("assistant", answer(country, city))]


def follow_up(first: tuple[str, str], more: list[tuple[str, str]], q: int, thanks: bool) -> list[dict]:
    chat = single(*first, q)
    for country, city in more:
        chat += [turn("user", f"And of {country}?"), turn("assistant", answer(country, city))]
    if thanks:
        chat += [turn("user", "Thanks!"), turn("assistant", "You are welcome.")]
    return chat


def brief(country: str, city: str, q: int) -> list[dict]:
    return [turn("system", SHORT), turn("user", QUESTIONS[q].format(country=country)), turn("assistant", f"{city}.")]


def conversations(seed: int = 0) -> tuple[list[list[dict]], list[list[dict]]]:
    """(training, held out): each (country, phrasing) pair opens rows of one of the two, never both."""
    rng = random.Random(seed)
    pairs = [(c, q) for c in range(len(CAPITALS)) for q in range(len(QUESTIONS))]
    rng.shuffle(pairs)
    held, kept = pairs[:16], pairs[16:]
    train = [single(*CAPITALS[c], q) for c, q in kept[:56]]
    train += [brief(*CAPITALS[c], q) for c, q in kept[56:68]]
    train += [follow_up(CAPITALS[c], rng.sample(CAPITALS, 1 + i % 3), q, thanks=i % 2 == 0)
              for i, (c, q) in enumerate(kept[68:])]
    held_out = [single(*CAPITALS[c], q) for c, q in held[:10]]
    held_out += [brief(*CAPITALS[c], q) for c, q in held[10:13]]
    held_out += [follow_up(CAPITALS[c], rng.sample(CAPITALS, 1), q, thanks=True) for c, q in held[13:]]
    rng.shuffle(train)
    return train, held_out


def write(path: Path, chats: list[list[dict]]) -> None:
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where chats.jsonl and chats-eval.jsonl go")
    folder = parser.parse_args().folder
    train, held_out = conversations()
    folder.mkdir(parents=True, exist_ok=True)
    write(folder / "chats.jsonl", train)
    write(folder / "chats-eval.jsonl", held_out)
    print(f"{len(train)} training and {len(held_out)} held-out conversations in {folder}")


if __name__ == "__main__":
    main()
