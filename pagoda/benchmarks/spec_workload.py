"""The prompts of `pagoda bench spec` (written for it): (a) input-grounded tasks whose
answers copy long spans of the prompt, (b) open chat."""

from __future__ import annotations

_TEXT = (
    "The river town woke slowly that morning. Fishermen pulled their boats onto the "
    "gravel, the baker opened her shutters, and a dog chased gulls along the harbour "
    "wall. By nine the market was full of voices: prices shouted, neighbours greeting "
    "each other, children asking for sweets. Nobody noticed the old man on the bench "
    "by the fountain, who had been sitting there since dawn, watching the water."
)
_TYPOS = (
    "Our team meats every monday at ten oclock in the small confrence room. Please "
    "bring you're laptop, the weekly report and any questions about the the new "
    "budget. If you can not attend, send a short note to the manger before the "
    "meeting so that we can reschedule the items you are responsable for."
)
_CODE = (
    "def total_price(items, tax):\n"
    "    s = 0\n"
    "    for it in items:\n"
    "        s = s + it.price * it.quantity\n"
    "    s = s * (1 + tax)\n"
    "    return round(s, 2)\n\n"
    "def cheapest(items):\n"
    "    best = None\n"
    "    for it in items:\n"
    "        if best is None or it.price < best.price:\n"
    "            best = it\n"
    "    return best\n"
)
_NOTES = (
    "Meeting notes, 14 March. Present: Ana, Ben, Chloe, David. Ana reported that the "
    "new warehouse will open on 2 April. Ben said the delivery vans need new tyres "
    "before then. Chloe will hire two more drivers. David asked for the budget to be "
    "sent to finance by Friday."
)

GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{_TEXT}",
    f"Correct the spelling mistakes in this text and repeat it in full:\n\n{_TYPOS}",
    (f"Rewrite this code, renaming the variable `s` to `subtotal` and `it` to `item`. "
    f"Give only the code.\n\n{_CODE}"),
    f"Summarise these notes, quoting each decision exactly as written:\n\n{_NOTES}",
]

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a child why the sky is blue.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe your ideal weekend in a few sentences.",
]

WORKLOADS = {"grounded": GROUNDED, "chat": CHAT}
