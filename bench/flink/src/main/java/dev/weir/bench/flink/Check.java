package dev.weir.bench.flink;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.ObjectReader;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.BitSet;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Reads a KafkaCount output topic as a downstream read_committed consumer
 * would and checks it: exactly EVENTS messages, every seq 0..EVENTS-1 once,
 * each message's Kafka key the decimal text of its "key", every key in one
 * partition with counts 1, 2, .., n in order of increasing seq.
 * Prints a JSON summary on stdout; exits 1 on the first problem.
 */
public class Check {
    public static void main(String[] args) throws Exception {
        if (args.length != 3) {
            System.err.println("usage: Check BOOTSTRAP TOPIC EVENTS");
            System.exit(2);
        }
        String topic = args[1];
        long events = Long.parseLong(args[2]);
        ObjectReader json = new ObjectMapper().readerFor(Event.class);
        Map<String, Object> config = new HashMap<>(Map.of(
                ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0],
                ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed",
                ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, false,
                ConsumerConfig.MAX_POLL_RECORDS_CONFIG, 5000));
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(config, new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            List<TopicPartition> partitions = new ArrayList<>();
            consumer.partitionsFor(topic, Duration.ofSeconds(30)).forEach(p -> partitions.add(new TopicPartition(topic, p.partition())));
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            Map<TopicPartition, Long> end = settledEnd(consumer, config, partitions);

            BitSet seen = new BitSet();
            Map<Long, long[]> keys = new HashMap<>(); // key -> {partition, last count, last seq}
            long messages = 0;
            Instant deadline = Instant.now().plusSeconds(300);
            while (partitions.stream().anyMatch(p -> consumer.position(p) < end.get(p))) {
                if (Instant.now().isAfter(deadline)) {
                    fail("reading " + topic + " did not reach its end offsets " + end);
                }
                for (ConsumerRecord<byte[], byte[]> r : consumer.poll(Duration.ofMillis(500))) {
                    Event e = json.readValue(r.value());
                    messages++;
                    if (e.seq < 0 || e.seq >= events || seen.get((int) e.seq)) {
                        fail("seq " + e.seq + " is out of range or repeated");
                    }
                    seen.set((int) e.seq);
                    if (r.key() == null || !new String(r.key(), StandardCharsets.UTF_8).equals(Long.toString(e.key))) {
                        fail("seq " + e.seq + ": message key " + (r.key() == null ? "null" : new String(r.key(), StandardCharsets.UTF_8)) + ", record key " + e.key);
                    }
                    long[] k = keys.computeIfAbsent(e.key, x -> new long[] {r.partition(), 0, -1});
                    if (k[0] != r.partition() || e.count != k[1] + 1 || e.seq <= k[2]) {
                        fail("key " + e.key + ": seq " + e.seq + " with count " + e.count + " in partition " + r.partition()
                                + " follows count " + k[1] + " (seq " + k[2] + ") in partition " + k[0]);
                    }
                    k[1] = e.count;
                    k[2] = e.seq;
                }
            }
            if (messages != events || seen.cardinality() != events) {
                fail("read " + messages + " messages (" + seen.cardinality() + " distinct seq), expected " + events);
            }
            long maxCount = keys.values().stream().mapToLong(k -> k[1]).max().orElse(0);
            System.out.printf("{\"topic\":\"%s\",\"messages\":%d,\"keys\":%d,\"max_count\":%d,\"key0_count\":%d,\"ok\":true}%n",
                    topic, messages, keys.size(), maxCount, keys.containsKey(0L) ? keys.get(0L)[1] : 0);
        }
    }

    /**
     * The read_committed end offsets once no transaction is open: a commit
     * returns to its producer once decided, its markers reach the partitions
     * a moment later (as in e2e/kafka/ReadTopic.java). One still open after
     * 20 s is a failure: the job left a transaction behind.
     */
    static Map<TopicPartition, Long> settledEnd(KafkaConsumer<byte[], byte[]> consumer, Map<String, Object> config, List<TopicPartition> partitions) throws InterruptedException {
        Map<String, Object> uncommittedConfig = new HashMap<>(config);
        uncommittedConfig.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_uncommitted");
        try (KafkaConsumer<byte[], byte[]> uncommitted = new KafkaConsumer<>(uncommittedConfig, new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            Instant settle = Instant.now().plusSeconds(20);
            Map<TopicPartition, Long> stable = consumer.endOffsets(partitions), high = uncommitted.endOffsets(partitions);
            while (!stable.equals(high)) {
                if (Instant.now().isAfter(settle)) {
                    fail("open transaction: stable offsets " + stable + ", high watermarks " + high);
                }
                Thread.sleep(200);
                stable = consumer.endOffsets(partitions);
                high = uncommitted.endOffsets(partitions);
            }
            return stable;
        }
    }

    static void fail(String problem) {
        System.err.println("check failed: " + problem);
        System.exit(1);
    }
}
