package dev.weir.bench.flink;

import com.fasterxml.jackson.annotation.JsonInclude;
import com.fasterxml.jackson.annotation.JsonPropertyOrder;

/**
 * One record: the input message {"seq","key","value"} and, once counted,
 * the output {"seq","key","value","count"} in the order weir writes them.
 * A Flink POJO (public fields, no-argument constructor), so Flink serializes
 * it between tasks with its own POJO serializer, not Kryo.
 */
@JsonPropertyOrder({"seq", "key", "value", "count"})
public class Event {
    public long seq;
    public long key;
    public long value;
    /** The key's running count; 0 (and not written) until counted. */
    @JsonInclude(JsonInclude.Include.NON_DEFAULT)
    public long count;

    public Event() {}
}
