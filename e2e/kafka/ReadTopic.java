// Prints the value of every message a read_committed consumer reads from a
// topic, one per line, from the beginning to the end every partition had
// when it started: what a downstream reader of a weir job's exactly-once
// output sees. Run by `e2e/kafka/broker read-topic` with the broker's own
// jars (Java's single-file source launcher).
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.StringDeserializer;

public class ReadTopic {
    public static void main(String[] args) throws Exception {
        if (args.length != 2) {
            System.err.println("usage: ReadTopic BOOTSTRAP TOPIC");
            System.exit(2);
        }
        Map<String, Object> config = Map.of(
            ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0],
            ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed",
            ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, false,
            ConsumerConfig.MAX_POLL_RECORDS_CONFIG, 5000);
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(config, new StringDeserializer(), new StringDeserializer())) {
            List<PartitionInfo> infos = consumer.partitionsFor(args[1], Duration.ofSeconds(30));
            if (infos == null || infos.isEmpty()) {
                System.err.println("topic " + args[1] + " does not exist");
                System.exit(1);
            }
            List<TopicPartition> partitions = new ArrayList<>();
            for (PartitionInfo p : infos) {
                partitions.add(new TopicPartition(p.topic(), p.partition()));
            }
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            // Under read_committed the end offsets are the last stable
            // offsets: an open transaction's messages lie beyond them. A
            // commit returns to its producer once decided; its markers
            // reach the partitions a moment later. So wait, a while, for
            // the last stable offsets to catch up with the high watermarks
            // (a transaction still open after that is read as open).
            Map<String, Object> uncommittedConfig = new java.util.HashMap<>(config);
            uncommittedConfig.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_uncommitted");
            Map<TopicPartition, Long> stable = consumer.endOffsets(partitions);
            try (KafkaConsumer<String, String> uncommitted = new KafkaConsumer<>(uncommittedConfig, new StringDeserializer(), new StringDeserializer())) {
                Instant settle = Instant.now().plusSeconds(20);
                Map<TopicPartition, Long> high = uncommitted.endOffsets(partitions);
                while (!stable.equals(high) && Instant.now().isBefore(settle)) {
                    Thread.sleep(200);
                    stable = consumer.endOffsets(partitions);
                    high = uncommitted.endOffsets(partitions);
                }
                // Said on stderr, so that a test can require none: a
                // transaction left open by a killed writer holds back every
                // read_committed reader of its partitions until it times out.
                for (TopicPartition p : partitions) {
                    if (!stable.get(p).equals(high.get(p))) {
                        System.err.println("open transaction: partition " + p + " is stable up to offset " + stable.get(p) + " of " + high.get(p));
                    }
                }
            }
            Map<TopicPartition, Long> end = stable;
            StringBuilder out = new StringBuilder();
            long count = 0;
            Instant deadline = Instant.now().plusSeconds(300);
            while (partitions.stream().anyMatch(p -> consumer.position(p) < end.get(p))) {
                if (Instant.now().isAfter(deadline)) {
                    System.err.println("reading " + args[1] + " did not reach its end offsets " + end);
                    System.exit(1);
                }
                for (ConsumerRecord<String, String> r : consumer.poll(Duration.ofMillis(500))) {
                    out.append(r.value()).append('\n');
                    count++;
                    if (out.length() > (1 << 20)) {
                        System.out.print(out);
                        out.setLength(0);
                    }
                }
            }
            System.out.print(out);
            System.out.flush();
            System.err.println("read " + count + " committed messages from " + args[1]);
        }
    }
}
