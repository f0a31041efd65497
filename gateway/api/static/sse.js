// Server-sent events over fetch: EventSource cannot POST or send an Authorization header, so the stream is
// read from a ReadableStream and parsed here, following the WHATWG event-stream rules (CR, LF or CRLF line
// ends, "data:" lines joined with "\n", comments starting with ":" ignored, an event ends at a blank line).

export class SSEParser {
  constructor() {
    this.buffer = "";
    this.data = [];
    this.type = "";
  }

  // Feeds decoded text; returns the events it completed, in order.
  push(text) {
    this.buffer += text;
    const events = [];
    for (;;) {
      const i = this.buffer.search(/[\r\n]/);
      if (i < 0) break;
      // A CR as the last character may be the first half of a CRLF split across two reads: wait for more.
      if (this.buffer[i] === "\r" && i === this.buffer.length - 1) break;
      const eol = this.buffer[i] === "\r" && this.buffer[i + 1] === "\n" ? 2 : 1;
      const event = this.line(this.buffer.slice(0, i));
      this.buffer = this.buffer.slice(i + eol);
      if (event !== null) events.push(event);
    }
    return events;
  }

  line(line) {
    if (line === "") {
      const event = this.data.length ? { type: this.type || "message", data: this.data.join("\n") } : null;
      this.data = [];
      this.type = "";
      return event;
    }
    if (line.startsWith(":")) return null; // a comment: the gateway's keep-alive ": ping"
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.type = value;
    return null;
  }
}

// Yields the events of a fetch Response's body. Aborting the fetch's signal makes the pending read reject
// with an AbortError, which is how the caller learns the user pressed Stop.
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      yield* parser.push(value);
    }
  } finally {
    // A consumer that stops early (an error event, [DONE]) closes the connection rather than leave it open.
    reader.cancel().catch(() => {});
  }
}
