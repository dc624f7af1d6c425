"""instructor's Mode.JSON against a running ddtree server (issue 55: json_object must be an
object). Not part of CI (instructor is not a test dependency); run in its own environment:

    python3 -m venv /tmp/inst && /tmp/inst/bin/pip install instructor openai
    ddtree serve --port 30000 --speculative-algorithm DDTREE --speculative-ddtree-budget auto &
    /tmp/inst/bin/python scripts/clients/instructor_json.py http://127.0.0.1:30000/v1

The embedded pair writes code, not prose, so the model's fields have defaults: what is checked is
that instructor gets a JSON object it can validate, seed after seed, with speculation on.
"""

import sys

import instructor
from openai import OpenAI
from pydantic import BaseModel


class Person(BaseModel):
    name: str = ""
    age: int = 0


def main(base_url: str) -> int:
    client = instructor.from_openai(
        OpenAI(base_url=base_url, api_key="-"), mode=instructor.Mode.JSON
    )
    ok = 0
    for seed in range(6):
        person = client.chat.completions.create(
            model="ddtree",
            response_model=Person,
            messages=[{"role": "user", "content": "A person as JSON"}],
            max_tokens=1024,
            temperature=0.8,
            seed=seed,
            max_retries=0,
        )
        print(f"seed {seed}: {person!r}")
        ok += isinstance(person, Person)
    print(f"instructor Mode.JSON: {ok}/6 validated")
    return 0 if ok == 6 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000/v1"))
