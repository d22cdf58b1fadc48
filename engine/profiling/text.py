"""Built-in calibration text for `tailorkv profile`.

Original prose written for this project (no downloaded data set): a story, an explanation, a set of
instructions, a letter, a dialogue, a fictional report with figures, a short program, a poem and an essay,
so that the calibration prompt mixes narrative, technical, numeric and conversational text. About 3,700
words, 4,656 tokens with the SmolLM2 tokenizer; `tailorkv profile --length N` uses its first N tokens.
"""

SOURCE = "built-in (engine/profiling/text.py)"

TEXT = """The Lighthouse Keeper's Ledger

When Ines Calloway took over the lighthouse at Gannet Point, the previous keeper left her three things: a brass key with a cracked bow, a tin of peppermints that had fused into a single sweet brick, and a ledger bound in green cloth. The key opened the lamp room. The peppermints went into the sea on her second day. The ledger she kept, because every page was filled with the same careful handwriting, and because the last entry, dated the night before she arrived, read only: "The fog came in from the wrong side again."

She did not understand it at first. Fog at Gannet Point came from the southwest, rolling off the cold current in long grey sheets that swallowed the rocks one by one. Everyone in the village said so. The ferry captain said so, the woman who sold her bread said so, and the tide tables pinned to the wall of the keeper's cottage said so in small print at the bottom of each month. Yet the ledger, going back eleven years, recorded forty-three nights on which the fog had come from the northeast, over the hills, against the wind.

Ines was not a superstitious person. She had trained as a surveyor before the lighthouse job, and she trusted instruments more than stories. So she did what a surveyor would do. She bought a second barometer, a cheap anemometer with a cup that squeaked, and a notebook with squared paper. Each evening at six she climbed the one hundred and twelve steps to the lamp room, wound the clockwork that turned the lens, wiped the salt from the glass, and wrote down the pressure, the wind speed, the wind direction, the temperature and the colour of the sky. Each morning she wrote down whether fog had come, and from where.

For two months nothing unusual happened. The fog came when the old keeper's ledger said it usually came, from the southwest, in the early hours after a warm afternoon. Then, on a still night in late October, with the pressure high and the wind barely turning the squeaking cups, she looked up from her notebook and saw a pale wall standing on the ridge behind the village. It did not roll. It poured. It came down the hillside like milk spilled on a tilted table, filled the streets, flowed around the church tower and reached the water's edge in less than twenty minutes. By the time it touched the foot of the lighthouse, the anemometer still pointed to the southwest, and the air on the gallery was perfectly dry.

She wrote it all down. Then she went back through the old ledger and copied every northeast fog into her squared notebook, together with the weather of the day before. A pattern appeared slowly, the way a coastline appears when a boat draws closer. Every one of those nights followed a clear, cold day with high pressure, and every one came after the farmers on the far side of the ridge had flooded their low fields, which they did in autumn to keep the soil from cracking. The water, cooled under a clear sky, breathed out a shallow layer of cold moist air. The air was heavier than the air around it, so it slid downhill, over the ridge and into the bay, carrying its own small fog with it.

The old keeper had never solved it, but he had never stopped writing it down either. Ines added a new column to the ledger, headed "fields flooded?", and left the rest of the page exactly as he had ruled it.

How a Refrigerator Moves Heat

A refrigerator does not make cold. It moves heat from a place where you do not want it, the inside of the cabinet, to a place where you do not mind it, the kitchen. The trick it uses is that a fluid absorbs a great deal of heat when it boils and releases the same heat when it condenses, and that the temperature at which a fluid boils depends on the pressure around it.

Inside the back wall of the cabinet runs a thin tube called the evaporator. A refrigerant enters it as a cold liquid at low pressure. At that low pressure its boiling point lies well below the temperature of the food, so it boils, drawing heat out of the cabinet air as it turns into vapour. The vapour then travels to the compressor, the humming box near the floor. The compressor squeezes the vapour, raising its pressure and, with it, its temperature, until it is warmer than the kitchen.

The hot vapour next passes through the condenser, the grid of tubes on the back or underneath the appliance. Because it is now warmer than the room, it gives up its heat to the air and condenses back into a liquid, still under high pressure. Finally the liquid passes through a narrow opening, the expansion valve or a long capillary tube, where its pressure drops suddenly. Some of it flashes into vapour, which cools the rest, and the cold low-pressure liquid returns to the evaporator to begin again.

Two consequences follow. First, the back of a refrigerator is warm for the same reason the inside is cold: the heat taken out of the food has to go somewhere. Second, leaving the door open to cool a hot kitchen makes the kitchen warmer, not cooler, since the machine dumps the heat it removes, plus the work done by the compressor, into the same room. An air conditioner avoids this by putting its condenser outside the building.

The efficiency of the cycle is described by the coefficient of performance, the heat moved divided by the electrical energy used. A household refrigerator typically moves two to three units of heat for every unit of electricity. The smaller the gap between the cabinet temperature and the room temperature, the better the ratio, which is why a freezer in a hot garage works harder than the same freezer in a cool cellar.

Instructions: Repotting a Root-Bound Plant

1. Water the plant thoroughly a day before you repot it. Moist roots slide out of the old pot more easily and tear less.
2. Choose a new pot only one size larger, about two to five centimetres wider than the old one. A pot that is much larger holds water the roots cannot reach, and the soil stays wet long enough to rot them.
3. Check that the new pot has a drainage hole. If it does not, use it as a decorative outer pot and keep the plant in a plastic pot inside it.
4. Put a layer of fresh potting mix in the bottom of the new pot, enough that the top of the root ball will sit about two centimetres below the rim.
5. Turn the old pot on its side, support the base of the stems with one hand, and tap or squeeze the pot until the root ball slides free. Never pull the plant out by its stems.
6. Look at the roots. If they circle the outside of the root ball in a dense mat, loosen them gently with your fingers, or make three or four shallow vertical cuts with a clean knife so that new roots grow outward.
7. Set the plant in the new pot, fill the gap around it with fresh mix, and press lightly to remove large air pockets. Do not pack the soil hard.
8. Water slowly until water runs out of the drainage hole, then let the pot drain completely.
9. Keep the plant out of strong direct sun for a week while the roots recover. Wait about a month before you feed it with fertiliser.

A common mistake is to repot in the middle of winter, when most houseplants grow slowly and take longer to recover. Early spring is usually the best time.

A Letter to a Younger Brother

Dear Tomasz,

Mum tells me you have started your first job at the print shop, and that you come home with ink on your elbows and a head full of words like "registration" and "bleed". I laughed when she told me, because I remember you at eight years old, refusing to write thank-you cards because the pen "did not feel right". Now you handle paper for a living.

I want to tell you a few things I wish someone had told me in my first year at work. They are not wise. They are only things I learned by getting them wrong.

Write down what people ask you to do, even when it seems simple. Especially when it seems simple. The simple requests are the ones you forget, because your mind files them under "obviously" and then loses the file.

When you make a mistake, say so early. The first hour after a mistake is cheap. The third day is expensive. People forgive an error much more easily than they forgive finding it themselves.

Learn the names of the people who clean the building and deliver the post. Not as a strategy, but because they know where everything is and nobody else bothers to ask them.

Do not try to look busy. Be busy when there is work and rest when there is not. Your supervisor has been watching people pretend for twenty years and can tell the difference.

And save a little from every payslip, even an amount so small it feels silly. The habit matters more than the sum.

I am coming home for the long weekend in May. If the shop is open, I would like to see where you work. Bring me something you printed yourself, even if it is only a menu for the café on the corner.

With love, and with the ink-stained hug you deserve,
Agnieszka

A Conversation at the Bus Stop

"Is this the stop for the number nine?"
"It is, but the nine doesn't run on Sundays. You want the fourteen, it goes the long way round but it gets there."
"How long is the long way?"
"Depends who's driving. Forty minutes, maybe. Fifty if it's Raymond. He stops to talk to everyone."
"You know the drivers by name?"
"I've taken this bus for thirty-one years. I know the drivers, their children, and which of them has a bad knee. Where are you headed?"
"The hospital. My sister just had a baby."
"Oh, congratulations! Boy or girl?"
"A girl. Seven pounds two ounces. They haven't picked a name yet. My sister wants something old-fashioned and her husband wants something nobody has ever heard of."
"They'll meet in the middle. My daughter and her husband argued for a week, and in the end they named the boy after the nurse who delivered him."
"That's lovely, actually."
"It is. The nurse cried. Here, look, that's the fourteen coming now. Sit on the left side, you get the view over the river."
"Thank you. Really. I'd still be standing here waiting for the nine."
"Give the baby a kiss from a stranger at the bus stop."

Quarterly Report of the Harrow Valley Water Cooperative (fictional)

The cooperative supplied 1,284,600 cubic metres of treated water in the third quarter, an increase of 4.7 percent over the same quarter last year. Average daily demand peaked at 16,920 cubic metres during the heat in the second week of August, about 9 percent below the capacity of the treatment plant. No supply interruptions longer than four hours were recorded.

Losses in the distribution network, estimated as the difference between water produced and water billed, fell from 18.3 percent to 15.9 percent. The improvement comes mainly from the replacement of 2.6 kilometres of cast-iron main along Mill Road and from a leak-detection survey that located 37 leaks, 29 of which have been repaired. The remaining 8 are on private service pipes, and their owners have been notified.

Water quality met the regulatory limits in all 412 samples taken at the plant and at customer taps. Turbidity at the plant outlet averaged 0.11 units, against a limit of 1.0. Two samples from the northern reservoir showed raised manganese after the storm of 3 September; the reservoir was isolated for six days, flushed and returned to service.

Operating costs were 2.41 million, of which energy accounted for 38 percent, chemicals for 11 percent, staff for 34 percent and maintenance for the rest. Energy use per cubic metre fell by 6 percent after the variable-speed drives were installed on the two main pumps in June.

For the fourth quarter, the board proposes to start the second phase of main replacement (Elm Street to the school, 1.4 kilometres), to complete the meter upgrade in the eastern district, and to hold the tariff at its current level until the annual meeting in March.

A Small Program

The following function counts how often each word appears in a text and returns the most frequent ones. It lowercases the text, treats anything that is not a letter as a separator, and breaks ties alphabetically so that the output does not depend on the order in which words were first seen.

def top_words(text, n=10):
    counts = {}
    word = []
    for ch in text.lower() + " ":
        if ch.isalpha():
            word.append(ch)
        elif word:
            w = "".join(word)
            counts[w] = counts.get(w, 0) + 1
            word = []
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:n]

For example, top_words("the cat and the hat and the bat", 2) returns [("the", 3), ("and", 2)]. The function reads the text once and sorts the distinct words once, so it runs in time proportional to the length of the text plus the number of distinct words times the logarithm of that number. For a very large text one would read it in pieces rather than all at once, but the counting logic stays the same.

Winter Orchard

The pear trees stand in rows like patient guests
who came too early and were asked to wait;
the frost has pinned a notice to each branch,
and every notice says the feast is late.

A blackbird tests the silence with one note,
then thinks the better of it, and is still.
The ladder that we left in late September
leans like a question on the farthest hill.

Below the snow the roots are keeping count
of days, in some slow arithmetic of cold,
and when the sum comes right they will remember
what every winter makes the branches hold.

On Maps and the Things They Leave Out

Every map is a decision about what to ignore. A road map leaves out the height of the hills, which matters a great deal to a cyclist and very little to a driver. A geological map leaves out the roads. A transit map of a city famously leaves out distance itself, stretching the quiet outer stations apart and squeezing the busy centre together, because a passenger cares about the order of stops and where to change lines, not about how many metres separate them. None of these maps is wrong. Each is faithful to a question.

The trouble begins when a map is used to answer a question it was not drawn for. A tourist who plans a walk from a transit map may find that two stations that look close are half an hour apart on foot, while two that look far apart share an entrance. A planner who judges a neighbourhood from a map of property values may miss that the same streets hold the city's oldest market and its best-loved park. The map did not lie. It simply did not say what it did not know, and the reader filled the silence with assumptions.

Good mapmakers deal with this in small, honest ways. They print the date of the survey, so that a reader knows how old the information is. They mark uncertain boundaries with dashed lines instead of solid ones. They include a legend that says not only what the symbols mean but what was left out on purpose. Some of the most useful maps ever made carry, in a corner, a short note that begins with the words "This map does not show".

The same discipline is useful far from cartography. A summary of a long report is a map of the report. A table of averages is a map of the measurements behind it. A model of a complicated system, whether it predicts the weather or the traffic on a bridge, is a map of that system drawn for particular questions. In each case the most valuable thing the author can do, after drawing the map well, is to say plainly which roads it leaves out.

The Night Market

By eight o'clock the car park behind the old textile mill had become a town of its own. Strings of bulbs ran from lamp post to lamp post, sagging in the middle like washing lines, and under them stood forty stalls in four uneven rows. The air smelled of charcoal, frying garlic, sugar and diesel from the generator that hummed behind the flower seller.

Rafael worked the dumpling stall with his aunt, who folded faster than anyone he had ever seen. She could pleat a wrapper with fourteen folds in the time it took him to make seven, and hers always stood up straight in the steamer while his leaned like tired soldiers. She never commented on this. She simply moved his dumplings to the back of the basket where customers would not see them first.

Across the aisle a man sold second-hand radios. He had arranged them by decade, from a walnut cabinet the size of a suitcase to a transistor set that fitted in a shirt pocket, and every one of them worked. Children crowded around him because he let them turn the dials, and each time a station came in through the hiss he raised his eyebrows as if it were a small miracle, which, he told Rafael once, it was.

At ten the rain started, lightly at first. The stallholders pulled tarpaulins over their tables with the unhurried movements of people who have done something a hundred times. The crowd thinned but did not vanish. A group of students sheltered under the dumpling stall's awning and ordered three more baskets, and Rafael's aunt, without a word, served them the straight ones.

Notes on Learning a Second Language as an Adult

Adults often believe they are worse at learning languages than children, and in one respect they are right: very few people who start after their early teens ever sound exactly like native speakers. In most other respects, adults learn faster. They already understand grammar as an idea, they can use a dictionary, they can ask what a word means, and they can plan their practice. A child needs years to reach the level of conversation an adult can reach in months.

What slows adults down is usually not ability but exposure and embarrassment. A child hears the language for many hours every day and is expected to make mistakes. An adult studies for an hour in the evening and feels foolish when they stumble in a shop. The most effective changes are therefore practical ones: listen to the language for longer, even in the background; read things you would read anyway, such as the news or a favourite kind of novel, in the new language; and arrange regular conversations with patient people, where mistakes are expected and corrected kindly.

It also helps to learn words in phrases rather than alone. "Take" is hard to use correctly; "take a seat", "take the train" and "take your time" are easy. Memory holds patterns more easily than it holds rules, and a small stock of complete phrases lets a learner say useful things long before the grammar behind them is clear.

Finally, progress in a language is uneven. There are long flat periods in which nothing seems to improve, followed by sudden weeks in which films become understandable and conversations stop feeling like exams. Learners who know this in advance are far more likely to keep going through the flat parts, and keeping going is most of the secret.

The Clockmaker's Apprentice

In the town of Verrin there was a clockmaker named Oswin Tell, whose shop stood at the bottom of a street so steep that carts were forbidden on it. His clocks were not the finest in the country, nor the cheapest, but they were famous for one thing: they never needed to be set. People said that a Tell clock, once started, kept the right time until the spring ran down, and that if you wound it again it picked up exactly where the sun said it should be.

When Oswin grew old he took an apprentice, a quiet girl called Maren, who had come to the shop to mend her grandmother's watch and had stayed to ask questions. For a year he let her do nothing but clean parts. For a second year she cut gears, hundreds of them, from brass blanks, and he threw most of them into a drawer without comment. In the third year he let her assemble a movement, and when it ran for a week and lost only four seconds, he nodded once and went back to his tea.

Maren wanted to know the secret of the clocks that never needed setting. Oswin told her there was no secret. She did not believe him. She measured every gear in his drawer, copied every drawing in his cupboard, and compared his springs with the springs from other makers, and she found nothing that was different. At last, in the winter of her fourth year, she followed him before dawn and saw where he went: from house to house across the town, letting himself in with keys the owners had given him, and nudging each clock by a few seconds against the watch he carried, which he set every morning by the noon gun at the harbour.

She asked him, on the walk back, why he did not simply tell people. He said that a clock that needs no care is a better story than a clockmaker who cares, and that the town liked its story. Then he gave her the ring of keys. She kept the rounds for thirty years, and she never told anyone either, until she took an apprentice of her own.
"""
